"""What a transformers member's weights will take, said before it loads: its parameters (from the
safetensors headers of a checkpoint folder, or a GGUF's tensor table) times the bytes of the dtype it
will run in. Its KV cache grows with each session (a ``DynamicCache``) and is not counted, as
``Member.nbytes`` (``get_memory_footprint``) does not count it either.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ...member_options import MemberOptions
from ...sources.gguf_shape import read_gguf_shape
from ..spec import split_target

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}
HEADER_MAX = 100 * 2**20  # a safetensors header longer than this is no header
HEADROOM = 1.05  # buffers beside the parameters (rotary tables, tied copies)


def parameters(folder: Path) -> int:
    """The parameters of every ``*.safetensors`` file in `folder`, from their headers."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > HEADER_MAX:
                raise ValueError(f"{file}: not a safetensors header")
            header = json.loads(handle.read(length))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for d in tensor["shape"]:
                    count *= d
                total += count
    return total


def estimate(target: str, shared: MemberOptions | None = None) -> int | None:
    """The bytes of the weights of ``load(target, shared)``; None where the folder has no safetensors files."""
    from ...models import CATALOGUE, resolve
    from ...sources import is_sourced
    from .load import pick_device
    from .member import TARGET_KEYS

    head, options = split_target(target, TARGET_KEYS, "transformers")
    path = Path(head).expanduser()
    if head in CATALOGUE or is_sourced(head):
        _, path, _ = resolve(head, (shared or MemberOptions()).cache_dir, checkpoint=True)
    dtype = str(options.get("dtype", "auto")).lower()
    if dtype == "auto":  # as pick_dtype: fp32 on a CPU, 2 bytes on a GPU
        dtype = "fp32" if pick_device(options.get("device")).startswith("cpu") else "bf16"
    # A GGUF file is dequantized: its tensors' elements, in the dtype.
    count = read_gguf_shape(path).n_elements if path.is_file() else parameters(path)
    return int(count * DTYPE_BYTES.get(dtype, 4) * HEADROOM) if count else None


__all__ = ["estimate", "parameters"]
