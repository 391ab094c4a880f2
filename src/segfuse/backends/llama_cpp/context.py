"""One llama.cpp context: its unified KV cache's sequences and the batched decodes into it.

Nothing here knows which session holds which sequence; ``slots.py`` keeps that
book and ``member.py`` (the member) puts the two together.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp as lc
import numpy as np

from ...errors import MemberLoadError, PromptTooLongError
from .runtime import COMPUTE, log_excerpt


def _no_room() -> bool:
    return False


# The member options' names for llama.cpp's values (member_options.CACHE_TYPES, FLASH_ATTN).
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


@dataclass(frozen=True)
class KvCache:
    """A member's KV-cache types (``f16``, ``q8_0``, ...) and flash attention (``on``, ``off``, ``auto``); None:
    llama.cpp's default (f16, auto)."""

    type_k: str | None = None
    type_v: str | None = None
    flash_attn: str | None = None

    def apply(self, params: Any) -> None:
        """Set them on llama_context_params (older bindings spell flash attention as a bool, ``flash_attn``)."""
        for field, name in (("type_k", self.type_k), ("type_v", self.type_v)):
            if name is not None:
                setattr(params, field, getattr(lc, f"GGML_TYPE_{name.upper()}"))
        if self.flash_attn is not None:
            if hasattr(params, "flash_attn_type"):
                params.flash_attn_type = FLASH_ATTN[self.flash_attn]
            else:
                params.flash_attn = self.flash_attn == "on"


class Context:
    """A context of `n_ctx` cells in `n_seq` sequences over a loaded model, and one reused batch.

    `window`: the tokens one session may hold, as errors quote it; `shape`: the context in words
    (for the error when llama.cpp cannot make it). `make_room`: called when a decode finds no free cell;
    True if it freed some (the prefix cache gives way first), so that the decode is tried again. `kv`: the
    cache's types and attention kernel.
    """

    def __init__(
        self,
        model: Any,
        *,
        name: str,
        n_ctx: int,
        n_batch: int,
        n_seq: int,
        threads: int,
        n_vocab: int,
        max_outputs: int,
        window: int,
        shape: str,
        compute: Callable[..., Any] = COMPUTE.run,
        kv: KvCache = KvCache(),
    ) -> None:
        self.name = name
        self.compute = compute  # where its decodes run: the process's compute thread, or here (side by side)
        self.window = window
        self.n_vocab = n_vocab
        self.n_batch = n_batch
        self.n_seq = n_seq
        self.max_outputs = max(1, max_outputs)  # logits rows one decode asks for (see decode)
        self.make_room: Callable[[], bool] = _no_room
        self._ctx = compute(_create, model, n_ctx, n_batch, n_seq, threads, shape, kv)
        self._mem = lc.llama_get_memory(self._ctx)
        self.n_cells = lc.llama_n_ctx(self._ctx)
        self._init_batch(n_batch)

    def _init_batch(self, n_batch: int) -> None:
        """One reused batch, its fields seen as NumPy arrays so that filling it is cheap."""
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._batch_tokens = np.ctypeslib.as_array(self._batch.token, shape=(n_batch,))
        self._batch_pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_batch,))
        self._batch_nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_batch,))
        self._batch_logits = np.ctypeslib.as_array(self._batch.logits, shape=(n_batch,))
        self._batch_nseq[:] = 1

    @property
    def is_open(self) -> bool:
        return bool(self._ctx)

    # --- decoding ---------------------------------------------------------------
    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int], outputs: Sequence[bool]
    ) -> np.ndarray:
        """Decode one batch; return the logits rows of tokens with an output flag.

        llama.cpp keeps a logits buffer as large as the most rows one decode ever asked for
        (a row is the vocabulary: 1 MiB for Gemma 3), so a batch asking for more than
        ``max_outputs`` rows is decoded in parts (each part's tokens after the earlier parts',
        in the same cache) and its rows are copied out. Memory then stays at the buffer reserved
        at load, however many sessions verify together.
        """
        flags = list(outputs)
        if sum(flags) <= self.max_outputs:
            return self._decode_once(tokens, positions, seqs, flags)
        parts, start, seen = [], 0, 0
        for end, flag in enumerate(flags, 1):
            seen += flag
            if seen == self.max_outputs or end == len(flags):
                parts.append(
                    self._decode_once(tokens[start:end], positions[start:end], seqs[start:end], flags[start:end]).copy()
                )
                start, seen = end, 0
        return np.concatenate(parts)

    def _decode_batch(self, batch: Any) -> int:
        """llama_decode's status for the filled batch (on the compute thread)."""
        status = int(lc.llama_decode(self._ctx, batch))
        while status == 1 and self.make_room():  # no room: cached prefixes give way first
            status = int(lc.llama_decode(self._ctx, batch))
        return status

    def reserve_outputs(self, n_ctx: int) -> None:
        """Grow llama.cpp's logits buffer to ``max_outputs`` rows now, once, rather than in steps while serving."""
        n = min(self.max_outputs, self.n_batch, n_ctx)
        self._decode_once([0] * n, list(range(n)), [0] * n, [True] * n)
        self.clear()

    def _decode_once(
        self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int], outputs: Sequence[bool]
    ) -> np.ndarray:
        n = len(tokens)
        if n > self.n_batch:
            raise ValueError("batch larger than n_batch")
        batch = self._batch
        batch.n_tokens = n
        self._batch_tokens[:n] = tokens
        self._batch_pos[:n] = positions
        self._batch_logits[:n] = outputs
        seq_ptrs = batch.seq_id
        for i, seq in enumerate(seqs):
            seq_ptrs[i][0] = seq
        status = self.compute(self._decode_batch, batch)
        if status == 1:
            raise PromptTooLongError(
                f"{self.name}: the context window ({self.window} tokens) is full",
                "shorten the prompt or lower --max-tokens",
            )
        if status != 0:
            raise MemberLoadError(f"{self.name}: llama_decode failed with status {status}", "see the log above")
        n_out = int(sum(1 for o in outputs if o))
        if n_out == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = lc.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    # --- the cache's sequences --------------------------------------------------------
    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """Drop sequence `seq`'s cells in positions [p0, p1) (-1: open-ended)."""
        if not lc.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise MemberLoadError(
                f"{self.name}: cannot remove cache cells [{p0}, {p1}) of sequence {seq}",
                "this model's cache does not support partial removal",
            )

    def seq_drop(self, seq: int) -> None:
        """Drop all of sequence `seq` (always possible)."""
        lc.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Make sequence `dst` share `src`'s cells in positions [p0, p1) (nothing is recomputed)."""
        lc.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_cells(self, seq: int) -> int:
        """Positions sequence `seq` holds."""
        last = lc.llama_memory_seq_pos_max(self._mem, seq)
        return last - lc.llama_memory_seq_pos_min(self._mem, seq) + 1 if last >= 0 else 0

    def seq_pos_min(self, seq: int) -> int:
        """The first position sequence `seq` holds in every layer (-1: none). A sliding-window model's
        window layers may hold fewer than the rest: this is where theirs start."""
        return int(lc.llama_memory_seq_pos_min(self._mem, seq))

    # --- a sequence's state (kept on disk between runs: persist.py) --------------------
    def state_get(self, seq: int) -> Any:
        """Sequence `seq`'s cells as llama.cpp writes them (a ctypes byte array)."""
        return self.compute(_state_get, self._ctx, seq, self.name)

    def state_set(self, seq: int, data: bytearray, start: int, length: int) -> bool:
        """Read `length` bytes of `data` from `start` (what :meth:`state_get` gave) into sequence `seq`,
        replacing what it held; False when llama.cpp refuses them (it then holds nothing)."""
        ok = bool(self.compute(_state_set, self._ctx, seq, data, start, length))
        if not ok:
            self.seq_drop(seq)
        return ok

    def held_cells(self) -> int:
        """Positions held, summed over the sequences (a cell two sequences share counts twice)."""
        return sum(self.seq_cells(seq) for seq in range(self.n_seq))

    def clear(self) -> None:
        """Empty the whole cache."""
        lc.llama_memory_clear(self._mem, False)

    def close(self) -> None:
        if self._ctx:
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            self._ctx = None


def _state_get(ctx: Any, seq: int, name: str) -> Any:
    size = lc.llama_state_seq_get_size(ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    if lc.llama_state_seq_get_data(ctx, buf, size, seq) != size:
        raise MemberLoadError(f"{name}: llama.cpp could not copy the state of sequence {seq}", "see the log above")
    return buf


def _state_set(ctx: Any, seq: int, data: bytearray, start: int, length: int) -> bool:
    buf = (ctypes.c_uint8 * length).from_buffer(data, start)
    return int(lc.llama_state_seq_set_data(ctx, buf, length, seq)) == length


def layout(kv: KvCache = KvCache()) -> dict[str, Any]:
    """What every context is made with that changes what its cells hold (beyond the model and the member's
    window and offload): the cache's types and attention kernel, as :func:`_create` leaves or sets them."""
    params = lc.llama_context_default_params()
    kv.apply(params)
    return {
        "type_k": int(params.type_k),
        "type_v": int(params.type_v),
        "flash_attn": int(getattr(params, "flash_attn_type", getattr(params, "flash_attn", 0))),
        "offload_kqv": bool(params.offload_kqv),
        "kv_unified": True,
        "swa_full": True,
    }


def _create(model: Any, n_ctx: int, n_batch: int, n_seq: int, threads: int, shape: str, kv: KvCache) -> Any:
    """A context of `n_ctx` cells shared by `n_seq` sequences in one unified cache, or a clear error."""
    params = lc.llama_context_default_params()
    kv.apply(params)
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    params.n_seq_max = n_seq
    params.n_threads = threads
    params.n_threads_batch = threads
    params.kv_unified = True  # candidate sequences share the prefix cells
    params.swa_full = True  # sliding-window layers must allow partial removal
    params.no_perf = True
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        detail = log_excerpt()
        raise MemberLoadError(
            f"llama.cpp could not create a context of {shape}" + (f" ({detail})" if detail else ""),
            "lower n_ctx or the number of concurrent sessions (max_concurrent); a quantized type_v needs "
            "flash_attn on or auto",
        )
    return ctx
