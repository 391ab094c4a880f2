"""llama.cpp's process-wide side: its log, the backend, the thread that computes, loading weights, threads,
log-softmax.

Nothing here knows about sessions or members; ``member.py`` (the member) and
``session.py`` (one request's cache) build on it.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import sys
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from ...errors import MemberLoadError
from ..compute import ComputeThread

# llama.cpp logs into a short buffer instead of the terminal; errors quote its tail.
# SEGFUSE_LLAMA_LOG=1 prints it as it comes.
_LOG_TAIL: deque[str] = deque(maxlen=40)
_LOG_ECHO = os.environ.get("SEGFUSE_LLAMA_LOG") == "1"


# What llama.cpp says it allocated for a member (its weights, KV cache, compute and output buffers), read from
# its log while a load is measured (``allocations``): it has no call that tells.
_BUFFER = re.compile(r"\b(?:model|KV|compute|output) buffer size =\s*([0-9.]+) MiB")
_MEASURING = threading.Lock()  # one measured load at a time: the log does not say whose buffer it is
_SEEN: list[int] | None = None


def _on_llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", "replace")
    _LOG_TAIL.append(line)
    if _SEEN is not None and (found := _BUFFER.search(line)):
        _SEEN.append(int(float(found[1]) * 2**20))
    if _LOG_ECHO:
        sys.stderr.write(line)


_LLAMA_LOG_CALLBACK = lc.llama_log_callback(_on_llama_log)  # kept: llama.cpp holds a pointer to it
lc.llama_log_set(_LLAMA_LOG_CALLBACK, ctypes.c_void_p(0))


@contextmanager
def allocations() -> Iterator[list[int]]:
    """The bytes of every buffer llama.cpp reports allocating inside the block (one block at a time)."""
    global _SEEN
    with _MEASURING:
        seen: list[int] = []
        _SEEN = seen
        try:
            yield seen
        finally:
            _SEEN = None


def log_excerpt() -> str:
    lines = [line.strip() for line in _LOG_TAIL if "error" in line.lower() or "failed" in line.lower()]
    return "; ".join(lines[-2:])


_BACKEND_READY = False
_BACKEND_LOCK = threading.Lock()


def amx_advertised() -> bool:
    """Whether the CPU claims Intel AMX (Linux: /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return any(line.startswith("flags") and "amx_int8" in line.split() for line in info)
    except OSError:
        return False


def use_extra_buffer_types() -> bool:
    """Whether llama.cpp may place weights in its extra CPU buffer types (AMX, repacked layouts).

    Not where the CPU advertises AMX: in some virtual machines it does so, yet AMX instructions
    fault (seen: a general protection fault in ggml_backend_amx_mul_mat on the first batched decode
    of a llama.cpp built with -march=native). SEGFUSE_LLAMA_EXTRA_BUFTS=1 (or 0) decides instead.
    """
    env = os.environ.get("SEGFUSE_LLAMA_EXTRA_BUFTS")
    return env == "1" if env in ("0", "1") else not amx_advertised()


ALL_LAYERS = -1  # llama.cpp's n_gpu_layers for "every layer"
SPLIT_MODES = {"none": lc.LLAMA_SPLIT_MODE_NONE, "layer": lc.LLAMA_SPLIT_MODE_LAYER, "row": lc.LLAMA_SPLIT_MODE_ROW}


def can_offload() -> bool:
    """Whether the installed llama.cpp was built with a GPU backend (CUDA, Metal, Vulkan, ...)."""
    return bool(lc.llama_supports_gpu_offload())


def gpu_layers_for(requested: int | None) -> int:
    """n_gpu_layers for a member: as asked, else every layer where llama.cpp can offload and none where it cannot."""
    if requested is not None:
        return requested
    return ALL_LAYERS if can_offload() else 0


# The one thread of the process on which llama.cpp computes (loads weights, decodes) for the members that
# share the CPU (``compute.py`` says why): on 2 cores, a member decoding while another thread's OpenMP team
# was alive took 1.30 s where it took 1.13-1.17 s alone (64 tokens, Qwen2.5-Coder-0.5B, 2 threads). Members
# side by side (wholly on a GPU, each on its own thread) compute where they are called (``compute_here``).
COMPUTE = ComputeThread("segfuse-llama")


def load_model(
    path: Path,
    *,
    gpu_layers: int = 0,
    main_gpu: int = 0,
    split: str = "layer",
    tensor_split: tuple[float, ...] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The model's weights (on the CPU, or `gpu_layers` layers on the GPU) and the model parameters llama.cpp
    was given, read back from its struct; or a clear error quoting llama.cpp's log."""
    params = lc.llama_model_default_params()
    params.n_gpu_layers = gpu_layers
    params.main_gpu = main_gpu
    params.split_mode = SPLIT_MODES[split]
    shares = None
    if tensor_split:
        devices = lc.llama_max_devices()
        if len(tensor_split) > devices:
            raise MemberLoadError(
                f"tensor_split has {len(tensor_split)} shares", f"this llama.cpp takes at most {devices}"
            )
        shares = (ctypes.c_float * devices)(*tensor_split)  # kept alive until the load returns
        params.tensor_split = ctypes.cast(shares, ctypes.POINTER(ctypes.c_float))
    params.use_extra_bufts = use_extra_buffer_types()
    given = {
        "n_gpu_layers": params.n_gpu_layers,
        "main_gpu": params.main_gpu,
        "split_mode": params.split_mode,
        "tensor_split": list(tensor_split or ()),
    }
    _LOG_TAIL.clear()
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    del shares
    if not model:
        detail = log_excerpt()
        raise MemberLoadError(
            f"llama.cpp could not load {path}" + (f" ({detail})" if detail else ""),
            "the file is corrupt, truncated or of an unsupported architecture; replace it "
            "(for embedded models: `segfuse models prepare`)",
        )
    return model, given


def offloaded_layers(n_gpu_layers: int, n_layer: int) -> int:
    """Layers llama.cpp puts on the GPU: none without a GPU backend; else up to every repeating layer and the
    output layer (n_layer + 1), -1 meaning all."""
    if not can_offload() or n_gpu_layers == 0:
        return 0
    total = n_layer + 1
    return total if n_gpu_layers < 0 else min(n_gpu_layers, total)


def placement(layers: int, total: int, main_gpu: int, split: str) -> str:
    """Where a member runs, in words: ``CPU``, or ``GPU 0: 25/25 layers``."""
    if layers == 0:
        return "CPU"
    where = f"GPU {main_gpu}" if split == "none" else "GPU"  # split by layer or row: over every GPU it sees
    return f"{where}: {layers}/{total} layers" + (" (rest on CPU)" if layers < total else "")


def init_backend() -> None:
    global _BACKEND_READY
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            lc.llama_backend_init()
            _BACKEND_READY = True


def default_threads() -> int:
    """Threads for llama.cpp: $SEGFUSE_THREADS, else all cores up to 8.

    Members run one at a time, so each may use every core; more than the
    physical cores only adds contention on a shared machine.
    """
    env = os.environ.get("SEGFUSE_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, os.cpu_count() or 1))


def threads_for(requested: int | None, on_cpu_layers: int) -> int:
    """Threads for a member: as asked; else, wholly on a GPU, 2 (the CPU only samples and feeds it);
    else every core up to 8 (the layers left on the CPU set the pace)."""
    if requested:
        return requested
    return min(2, default_threads()) if on_cpu_layers == 0 else default_threads()


def side_by_side_for(requested: str | None, on_gpu_layers: int, total: int) -> bool:
    """Whether a member's calls may run in a thread beside other members': as asked ("on", "off"); else
    ("auto", None) only when every layer is on a GPU, where its decodes keep its device busy and leave
    the CPU free. Members on the CPU share its cores: beside each other they would only contend."""
    if requested in ("on", "off"):
        return requested == "on"
    return total > 0 and on_gpu_layers >= total


class LogSoftmax:
    """log-sum-exp over one vocabulary with a reused work buffer.

    Rows are read in place from llama.cpp's logits buffer; only the target
    token's log-probability is needed, so nothing vocabulary-sized is allocated
    per row.
    """

    def __init__(self, n_vocab: int) -> None:
        self._buf = np.empty(n_vocab, dtype=np.float32)

    def lse(self, row: np.ndarray) -> float:
        top = float(row.max())
        np.subtract(row, top, out=self._buf)
        np.exp(self._buf, out=self._buf)
        return top + math.log(float(self._buf.sum()))

    def probs(self, row: np.ndarray, temperature: float) -> np.ndarray:
        """softmax(row / temperature), in the work buffer (valid until the next call)."""
        np.multiply(row, np.float32(1.0 / temperature), out=self._buf)
        self._buf -= self._buf.max()
        np.exp(self._buf, out=self._buf)
        self._buf /= self._buf.sum()
        return self._buf
