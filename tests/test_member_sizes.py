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
    assert shape.kv_bytes_per_cell("q8_0", "f32") == 30 * 3 * 64 * (34 / 32 + 4)
    # A context of 2 sessions of 1024 tokens and as many cells for the prefix cache: 4096 cells.
    assert size_of(shape, n_ctx=1024, slots=2).kv_cache == 4096 * shape.kv_bytes_per_cell()
    assert size_of(shape, n_ctx=1024, slots=2, prefix_cache_cells=0).kv_cache == 2048 * shape.kv_bytes_per_cell()


@pytest.mark.parametrize(
    ("model", "kv"),
    [
        ("smollm2-135m", {}),
        ("gemma3-270m", {}),
        ("smollm2-135m", {"type_k": "q8_0", "type_v": "q8_0"}),  # a quantized cache: 34 bytes a block of 32
        ("smollm2-135m", {"type_k": "f32", "type_v": "f32", "flash_attn": "off"}),  # attention scores in the buffer
    ],
)
def test_the_estimate_errs_high_by_at_most_a_fifth(model, kv):
    options = MemberOptions.build({"n_ctx": 1024, "slots": 2, "threads": 1, **kv})
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


def test_a_transformers_checkpoint_counts_its_parameters_from_the_safetensors_headers(tmp_path):
    import json
    import struct

    from segfuse.backends.transformers.sizes import HEADROOM, parameters

    header = {"__metadata__": {}, "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}}
    header["b"] = {"dtype": "BF16", "shape": [5], "data_offsets": [48, 58]}
    body = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + bytes(58))
    assert parameters(tmp_path) == 17
    assert estimate_bytes(f"transformers:{tmp_path}#dtype=bf16") == int(17 * 2 * HEADROOM)
    # A GGUF file dequantized: its elements, in fp32 on the CPU (the real footprint was 513 MiB: 134,515,008 x 4).
    _, path, _ = resolve("smollm2-135m")
    assert read_gguf_shape(path).n_elements == 134_515_008
    assert estimate_bytes("transformers:smollm2-135m#device=cpu") == int(134_515_008 * 4 * HEADROOM)
