"""Loading a transformers member's tokenizer and weights: the device and dtype chosen, and a GGUF file
dequantized by transformers (through the ``gguf`` package) on first use and saved as a regular checkpoint
under the cache directory, so that later loads skip the conversion. Nothing is downloaded:
``local_files_only`` always.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer

from ...errors import MemberLoadError
from ...models import cache_dir as default_cache_dir
from ...models import is_gguf
from ..compute import ComputeThread, device_thread

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
_CONVERT_LOCK = threading.Lock()


def pick_device(device: str | None) -> str:
    if device:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_thread(device: str) -> ComputeThread:
    """The compute thread of the device a member runs on (``cpu``, ``cuda:N``; ``cuda`` is the current one;
    ``auto``, spread over GPUs by accelerate, has one of its own), with torch's intra-op thread count as
    set now: OpenMP reads it per thread (it is set again there for every member: ``match_threads``)."""
    key = device
    if device == "cuda":
        key = f"cuda:{torch.cuda.current_device()}"

    def setup() -> None:
        if key.startswith("cuda:"):
            torch.cuda.set_device(key)  # the current device is per thread too

    return device_thread(key, setup)


def cudnn_attention_off() -> bool:
    """Leave cuDNN's attention kernel out of torch's choice for scaled dot-product attention, process-wide
    (the flash and memory-efficient kernels remain); whether it was left out.

    cuDNN builds an execution plan for every new shape of attention and caches it per thread: a decode
    meets a new key length at every token, and a verification of candidates a new shape at every round, so
    each of them paid for a plan (tens of milliseconds a token on an H200, where a token took 20). torch's
    other kernels need no plan. SEGFUSE_CUDNN_ATTENTION=1 keeps cuDNN's kernel in the choice."""
    if os.environ.get("SEGFUSE_CUDNN_ATTENTION") == "1" or not torch.cuda.is_available():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def match_threads(count: int) -> None:
    """Make torch's intra-op thread count `count` on the calling thread (OpenMP keeps it per thread)."""
    torch.set_num_threads(count)


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto`: fp32 on CPU (bf16 matmuls are slow there), bf16 on GPUs that have it, else fp16."""
    if dtype != "auto":
        try:
            return DTYPES[dtype.lower()]
        except KeyError:
            raise MemberLoadError(f"unknown dtype {dtype!r}", f"choose auto, {', '.join(DTYPES)}") from None
    if device.startswith("cpu") or not torch.cuda.is_available():
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def converted_dir(gguf: Path, dtype: torch.dtype, cache: str | os.PathLike[str] | None) -> Path:
    """Where a GGUF file's dequantized checkpoint is kept (keyed by file identity and dtype)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}".encode()).hexdigest()[:16]
    return default_cache_dir(cache) / "transformers" / f"{gguf.stem}-{key}"


def convert_gguf(
    gguf: Path, dtype: torch.dtype, cache: str | os.PathLike[str] | None, target: Path | None = None
) -> Path | None:
    """Dequantize a GGUF file once into a checkpoint directory (`target`, else one in the cache);
    return the directory.

    None when transformers keeps this file's weights in GGUF blocks instead of
    dequantizing them: then there is nothing to cache and the file is loaded as is.

    Written to a temporary directory and renamed into place, so a crash never
    leaves a half-written checkpoint behind; a lock file beside it makes a second
    process that wants the same checkpoint wait for the first one's instead of
    converting it again (and failing to rename onto it).
    """
    target = target or converted_dir(gguf, dtype, cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _CONVERT_LOCK, FileLock(f"{target}.lock"):
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=dtype, **kwargs)
            quantizer = getattr(model, "hf_quantizer", None)
            if quantizer is not None and getattr(quantizer, "packed_modules", None):
                return None  # weights stay in GGUF blocks (transformers' GGUF kernels): nothing to cache
            # The weights were dequantized into plain tensors: it is an ordinary checkpoint now.
            model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module types attributes as tensors or modules
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)
        except Exception as exc:
            raise MemberLoadError(
                f"transformers could not convert {gguf}: {exc}",
                "this GGUF architecture or quantization may be unsupported by transformers; "
                "use the llama.cpp backend for it",
            ) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_checkpoint(
    source: Path,
    *,
    device: str,
    dtype: torch.dtype,
    trust_remote_code: bool,
    cache_dir: str | os.PathLike[str] | None,
    attn_implementation: str,
) -> tuple[Any, Any]:
    """Tokenizer and weights (in eval mode, on `device`) from a checkpoint directory, or a GGUF file
    (dequantized once, cached)."""
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    directory = source
    if is_gguf(source):
        converted = convert_gguf(source, dtype, cache_dir)
        directory = converted or source.parent
        if converted is None:
            kwargs["gguf_file"] = source.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
        placement = {"device_map": "auto"} if device == "auto" else {}
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype, attn_implementation=attn_implementation, **placement, **kwargs
        )
    except (OSError, ValueError) as exc:
        raise MemberLoadError(
            f"transformers could not load {directory}: {exc}",
            "is it a complete causal-LM checkpoint? (trust_remote_code is off)",
        ) from None
    if device != "auto":
        model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) override misleads mypy
    model.eval()  # type: ignore[no-untyped-call]  # transformers' override of eval has no annotations
    return tokenizer, model
