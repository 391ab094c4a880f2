"""What a llama.cpp member will take in memory, said before it loads, from its GGUF header and the
options it would load with (a server's memory budget must not be passed by a first load).

The parts llama.cpp allocates, each as ``member.py`` lays its context out:

- the weights: every tensor's bytes, from the tensor table, and on a CPU that uses llama.cpp's repacked
  layouts a second copy of the layers' matrices of the types it repacks;
- the KV cache: ``n_ctx x slots`` cells for the sessions plus the prefix cache's cells (by default as
  many again), in one unified cache, every layer full (``swa_full``): cells x layers x KV heads x
  (key + value length) x the bytes of an element of ``type_k`` and ``type_v`` (f16: 2);
- the compute buffer: the larger of one batch's logits (``n_vocab x n_ubatch`` floats) and, with flash
  attention off, one layer's attention scores (cells x ``n_ubatch`` x heads floats), and the activations;
- the output buffer: the logits rows kept for the sequences (at least ``max_outputs``).

Measured against what llama.cpp reports once loaded (docs/server.md, Several models), the sum is a little
high, on purpose: ``HEADROOM`` covers what the header cannot tell (a build that repacks more types, the
graph's other buffers). On a GPU the parts are the same, but where each lies is not told apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...member_options import MemberOptions
from ...sources.gguf_shape import GGUFShape, read_gguf_shape
from ..spec import split_target
from .slots import SEQS_PER_SESSION, prefix_entries

N_BATCH, MAX_OUTPUTS, N_UBATCH = 512, 64, 512  # LlamaCppMember's defaults, llama.cpp's micro-batch
CELL_PAD = 256  # llama.cpp rounds a unified cache's cells up to this
ACTIVATIONS = 4  # rows of n_embd floats per batch token beside the logits (2 measured on CPU: room for more)
SCORES = 1.15  # attention scores without flash attention, with their softmax's scratch (1.1 measured)
HEADROOM = 1.05
FLOAT = 4


@dataclass(frozen=True)
class LlamaCppSize:
    """A llama.cpp member's bytes by part, before headroom."""

    weights: int
    kv_cache: int
    compute: int
    outputs: int

    def total(self) -> int:
        """The estimate: every part, with ``HEADROOM``."""
        return int((self.weights + self.kv_cache + self.compute + self.outputs) * HEADROOM)


def size_of(
    shape: GGUFShape,
    *,
    n_ctx: int,
    slots: int,
    prefix_cache_cells: int | None = None,
    n_batch: int = N_BATCH,
    max_outputs: int = MAX_OUTPUTS,
    repacked: bool = False,
    kv: tuple[str | None, str | None, str | None] = (None, None, None),
) -> LlamaCppSize:
    """The parts of a member of `shape` loaded with these options (``LlamaCppMember``'s); `repacked`: its
    weights run on a CPU in llama.cpp's repacked layouts; `kv`: its cache's type_k, type_v and flash_attn
    (None: f16, f16, auto, which is on wherever it can be)."""
    cells = n_ctx * slots if prefix_cache_cells is None else prefix_cache_cells
    entries = prefix_entries(slots, cells, reencode=False)
    total_cells = n_ctx * slots + (cells if entries else 0)
    total_cells = -(-total_cells // CELL_PAD) * CELL_PAD
    n_seq = SEQS_PER_SESSION * slots + entries
    ubatch = min(n_batch, N_UBATCH)
    type_k, type_v, flash_attn = kv
    scores = int(total_cells * shape.n_head * SCORES) if flash_attn == "off" else 0
    return LlamaCppSize(
        weights=shape.tensor_bytes + (shape.repackable_bytes if repacked else 0),
        kv_cache=total_cells * shape.kv_bytes_per_cell(type_k, type_v),
        compute=ubatch * (max(shape.n_vocab, scores) + ACTIVATIONS * shape.n_embd) * FLOAT,
        outputs=max(n_seq, min(max_outputs, n_batch, n_ctx)) * shape.n_vocab * FLOAT,
    )


def estimate(target: str, shared: MemberOptions | None = None) -> int:
    """The bytes the member ``load(target, shared)`` would take (raises what resolving or reading it raises)."""
    from ...models import resolve
    from .member import LlamaCppOptions
    from .runtime import gpu_layers_for, use_extra_buffer_types

    head, spec = split_target(target, LlamaCppOptions.model_fields, "llama_cpp")
    options = (shared or MemberOptions()).merged(LlamaCppOptions, spec, where=f"member {target!r}")
    _, path, _ = resolve(head, options.cache_dir)
    size = size_of(
        read_gguf_shape(path),
        n_ctx=options.n_ctx or 4096,
        slots=options.slots or 1,
        prefix_cache_cells=options.prefix_cache_cells,
        n_batch=options.n_batch or N_BATCH,
        max_outputs=options.max_outputs or MAX_OUTPUTS,
        repacked=use_extra_buffer_types() and gpu_layers_for(options.gpu_layers) == 0,
        kv=(options.type_k, options.type_v, options.flash_attn),
    )
    return size.total()


__all__ = ["LlamaCppSize", "estimate", "size_of"]
