"""A GGUF model's shape, read from its header: what its weights take and what one KV-cache cell takes.

Enough to say how many bytes a member will take before it loads (a server's memory budget): the
tensor table gives every tensor's shape and ggml type, so their bytes sum exactly; the metadata
gives the layers and the attention heads a KV cache is made of. Nothing past the header is read.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFileError
from .gguf_info import _ARRAY, _SCALAR, BAD_FILE_HINT, MAGIC, _Header, _Truncated

KV_BYTES = 2  # llama.cpp's KV cache is f16 unless told otherwise
REPACKED = {"Q4_0", "Q4_K", "IQ4_NL"}  # types whose layer matrices llama.cpp's CPU backend repacks (a copy)


@dataclass(frozen=True)
class GGUFShape:
    """What a GGUF file's weights and KV cache take."""

    path: Path
    tensor_bytes: int  # every tensor's data, summed from the tensor table (the file's data part if a type is unknown)
    n_elements: int  # every tensor's elements (the parameters)
    repackable_bytes: int  # the layers' matrices llama.cpp's CPU backend keeps a repacked copy of (REPACKED types)
    n_layer: int  # {arch}.block_count
    kv_heads: tuple[int, ...]  # KV heads per layer ({arch}.attention.head_count_kv; one value for every layer)
    key_length: int  # per head ({arch}.attention.key_length, else embedding_length / head_count)
    value_length: int
    n_embd: int
    n_head: int  # attention (query) heads
    n_vocab: int  # tokens in the vocabulary

    def kv_bytes_per_cell(self, type_k: str | None = None, type_v: str | None = None) -> int:
        """Keys and values of one position in every layer, in the cache's ggml types (None: f16)."""
        heads = self.kv_heads if len(self.kv_heads) == self.n_layer else (self.kv_heads[0],) * self.n_layer
        per_head = self.key_length * element_bytes(type_k) + self.value_length * element_bytes(type_v)
        return int(sum(heads) * per_head)


def element_bytes(ggml_type: str | None) -> float:
    """Bytes per element of a ggml type by name (``f16``, ``q8_0``: 34 bytes a block of 32); None: f16."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if ggml_type is None:
        return KV_BYTES
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type.upper()]]
    return size / block


def read_gguf_shape(path: Path) -> GGUFShape:
    """`path`'s shape; ModelFileError if it is missing, no GGUF, truncated, or lacks the attention's sizes."""
    try:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != MAGIC:
                raise ModelFileError(f"{path} is not a GGUF file", BAD_FILE_HINT)
            return _shape(path, data)
    except OSError as exc:
        raise ModelFileError(f"cannot read {path}: {exc.strerror or exc}", "check the path") from None
    except _Truncated:
        raise ModelFileError(f"{path} is truncated", "the file is corrupt or was cut short; replace it") from None


def _shape(path: Path, data: mmap.mmap) -> GGUFShape:
    header = _Header(data)
    header.pos = 8  # past the magic and the version
    tensors, count = int(header.scalar("<Q")), int(header.scalar("<Q"))
    values = _metadata(header, count)
    alignment = values.get("general.alignment")
    table = _tensor_table(header, tensors, len(data), alignment if isinstance(alignment, int) else 32)
    arch = values.get("general.architecture")

    def number(key: str, default: int | None = None) -> int:
        value = values.get(f"{arch}.{key}", default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelFileError(f"{path} does not say its {key}", "give a llama.cpp model file with full metadata")
        return value

    n_embd, n_head = number("embedding_length"), number("attention.head_count")
    heads = values.get(f"{arch}.attention.head_count_kv", n_head)
    kv_heads = tuple(heads) if isinstance(heads, list) else (heads if isinstance(heads, int) else n_head,)
    tokens = values.get("tokenizer.ggml.tokens")
    return GGUFShape(
        path=path,
        tensor_bytes=table[0],
        n_elements=table[1],
        repackable_bytes=table[2],
        n_layer=number("block_count"),
        kv_heads=kv_heads,
        key_length=number("attention.key_length", n_embd // max(1, n_head)),
        value_length=number("attention.value_length", n_embd // max(1, n_head)),
        n_embd=n_embd,
        n_head=n_head,
        n_vocab=number("vocab_size", tokens if isinstance(tokens, int) else 0),
    )


def _metadata(header: _Header, count: int) -> dict[str, object]:
    """Every scalar, the architecture's name, an integer array of KV heads, and other arrays' lengths."""
    values: dict[str, object] = {}
    for _ in range(count):
        key = header.string()
        vtype = int(header.scalar("<I"))
        if vtype != _ARRAY:
            values[key] = header.value(vtype, keep=key == "general.architecture")
            continue
        start = header.pos
        etype, length = int(header.scalar("<I")), int(header.scalar("<Q"))
        if key.endswith(".attention.head_count_kv") and etype in _SCALAR and etype not in (6, 7, 12):
            values[key] = [int(header.scalar(_SCALAR[etype])) for _ in range(length)]
            continue
        values[key] = length  # a vocabulary: its size is all this needs
        header.pos = start
        header._skip_array()
    return values


def _tensor_table(header: _Header, tensors: int, size: int, alignment: int) -> tuple[int, int, int]:
    """The tensors' bytes as their types and shapes say (a type the gguf package does not know: the file's
    data part instead, all of it, padding included: never less), their elements, and the repackable bytes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    total, count, repackable, unknown = 0, 0, 0, False
    for _ in range(tensors):
        name = header.string()
        dims = [int(header.scalar("<Q")) for _ in range(int(header.scalar("<I")))]
        ttype = int(header.scalar("<I"))
        header.scalar("<Q")  # its offset
        elements = 1
        for d in dims:
            elements *= d
        count += elements
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            unknown = True
            continue
        nbytes = elements // block * type_size
        total += nbytes
        if name.startswith("blk.") and len(dims) == 2 and GGMLQuantizationType(ttype).name in REPACKED:
            repackable += nbytes
    if unknown:
        return size - (-(-header.pos // max(1, alignment)) * alignment), count, repackable
    return total, count, repackable


__all__ = ["KV_BYTES", "REPACKED", "GGUFShape", "element_bytes", "read_gguf_shape"]
