"""A member's bytes said before it loads (a server's memory budget): the GGUF header's sums, and the estimate
against what llama.cpp reports allocating once the member is loaded (within 20 %, never below)."""

from __future__ import annotations

import pytest

from segfuse.backends.llama_cpp.sizes import size_of
from segfuse.backends.registry import estimate_bytes, load_member
from segfuse.member_options import MemberOptions
from segfuse.models import resolve
from segfuse.sources.gguf_shape import read_gguf_shape

pytestmark = pytest.mark.models


def test_the_header_sums_the_weights_as_llama_cpp_counts_them_and_one_cell_of_every_layer():
    _, path, _ = resolve("smollm2-135m")
    shape = read_gguf_shape(path)
    assert shape.tensor_bytes == 96_576_768  # llama_model_size of the loaded model says the same
    assert (shape.n_layer, shape.kv_heads, shape.key_length, shape.n_vocab) == (30, (3,), 64, 49152)
    assert shape.kv_bytes_per_cell() == 2 * 30 * 3 * 64 * 2
    # A context of 2 sessions of 1024 tokens and as many cells for the prefix cache: 4096 cells.
    assert size_of(shape, n_ctx=1024, slots=2).kv_cache == 4096 * shape.kv_bytes_per_cell()
    assert size_of(shape, n_ctx=1024, slots=2, prefix_cache_cells=0).kv_cache == 2048 * shape.kv_bytes_per_cell()


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_estimate_errs_high_by_at_most_a_fifth(model):
    options = MemberOptions.build({"n_ctx": 1024, "slots": 2, "threads": 1})
    estimate = estimate_bytes(model, options)
    member = load_member(model, options)
    try:
        real = member.nbytes
    finally:
        member.close()
    assert estimate is not None and real is not None
    assert real > read_gguf_shape(member.path).tensor_bytes  # the caches are counted, not the weights alone
    assert 1.0 <= estimate / real <= 1.2, (estimate, real)


def test_no_estimate_where_the_file_cannot_be_read_or_the_backend_cannot_say(tmp_path):
    assert estimate_bytes(str(tmp_path / "missing.gguf")) is None
    assert estimate_bytes("remote:http://127.0.0.1:9/v1#far") is None
