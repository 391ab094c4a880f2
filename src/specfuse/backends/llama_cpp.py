"""llama.cpp members through llama-cpp-python's low-level API.

KV-cache layout per session (NOTES §2):
- sequence 0 holds the context (prompt + accepted answer) and, while a round
  runs, the member's own draft tail;
- verifying copies the context into sequences 1..n (cells are shared in the
  unified cache, nothing is recomputed) and decodes all candidates in one
  batch, each in its own sequence with restarted positions;
- accepting keeps the cells that already hold the winner: the member's own
  draft tokens, or the verified candidate's sequence copied back into 0.
So no round re-encodes the prompt or earlier accepted text; the only extra
decode is the last token of a fully kept own draft, fed next round.

Several sessions at once (``slots``): the context holds ``slots`` windows of
``n_ctx`` tokens, and session k owns sequences 8k..8k+7 of the unified cache.
``draft_many`` advances every drafting session by one token per
``llama_decode``; ``score_many`` verifies every session's candidates in one
batch (chunked at ``n_batch``). One session alone decodes exactly as before.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from ..errors import MemberLoadError, PromptTooLongError
from ..models import PromptFormat, check_gguf
from ..prompting import choose_format, render_chat, render_plain
from ..types import DraftTokens, Message, Sampling, TokenScores
from .base import Capabilities, Occupancy
from .cached import CachedSession, DraftState, LocalMember, Verified

# llama.cpp logs into a short buffer instead of the terminal; errors quote its tail.
# SPECFUSE_LLAMA_LOG=1 prints it as it comes.
_LOG_TAIL: deque[str] = deque(maxlen=40)
_LOG_ECHO = os.environ.get("SPECFUSE_LLAMA_LOG") == "1"


@lc.llama_log_callback
def _on_llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", "replace")
    _LOG_TAIL.append(line)
    if _LOG_ECHO:
        print(line, end="", file=sys.stderr)


lc.llama_log_set(_on_llama_log, ctypes.c_void_p(0))


def _log_excerpt() -> str:
    lines = [line.strip() for line in _LOG_TAIL if "error" in line.lower() or "failed" in line.lower()]
    return "; ".join(lines[-2:])
_BACKEND_READY = False
_BACKEND_LOCK = threading.Lock()
MAX_CANDIDATES = 7  # sequences 1..7 of a session hold one distinct candidate each per round
SEQS_PER_SESSION = MAX_CANDIDATES + 1


def _load_model(path: Path) -> Any:
    """The model's weights on the CPU, or a clear error quoting llama.cpp's log."""
    params = lc.llama_model_default_params()
    params.n_gpu_layers = 0
    _LOG_TAIL.clear()
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        detail = _log_excerpt()
        raise MemberLoadError(
            f"llama.cpp could not load {path}" + (f" ({detail})" if detail else ""),
            "the file is corrupt, truncated or of an unsupported architecture; replace it "
            "(for embedded models: `specfuse models prepare`)",
        )
    return model


def _init_backend() -> None:
    global _BACKEND_READY
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            lc.llama_backend_init()
            _BACKEND_READY = True


def default_threads() -> int:
    """Threads for llama.cpp: $SPECFUSE_THREADS, else all cores up to 8.

    Members run one at a time, so each may use every core; more than the
    physical cores only adds contention on a shared machine.
    """
    env = os.environ.get("SPECFUSE_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, os.cpu_count() or 1))


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


@dataclass
class _InSequence(Verified):
    seq: int  # the cache sequence holding the candidate's cells


@dataclass
class _VerifyPlan:
    """One session's part of a verification batch."""

    session: "LlamaCppSession"
    texts: list[str]
    results: dict[str, TokenScores]  # known already (verified this round, or the end token)
    pending: list[str] = field(default_factory=list)
    encoded: list[list[int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)

    def answer(self) -> list[TokenScores]:
        return [self.results[t] for t in self.texts]


class _Drafting:
    """One session's draft in progress: sample from the current row, feed the token, repeat."""

    def __init__(self, session: "LlamaCppSession", n: int, sampling: Sampling, row: np.ndarray,
                 lse: float) -> None:
        self.session, self.n, self.sampling = session, n, sampling
        self.row, self.lse = row, lse
        self.pos = len(session.tokens)
        self.ids: list[int] = []
        self.rows: list[np.ndarray] = []  # rows[j]: logits used to sample ids[j]
        self.logprobs: list[float] = []
        self.logits: list[float] = []
        self.finished = False
        self.done = n <= 0

    def step(self, m: "LlamaCppMember") -> bool:
        """Sample the next token; True when it must be decoded for the draft to go on."""
        if self.done:
            return False
        self.rows.append(self.row)
        token = self.session._sample(self.row, self.sampling)
        self.ids.append(token)
        self.logits.append(float(self.row[token]))
        self.logprobs.append(self.logits[-1] - self.lse)
        self.finished = m.is_eog(token)
        self.done = self.finished or len(self.ids) >= self.n
        return not self.done

    def fed(self, row: np.ndarray, lse: float) -> None:
        self.row, self.lse = row, lse
        self.pos += 1
        self.session.stats.draft += 1
        self.session.stats.decode_calls += 1

    def finish(self, m: "LlamaCppMember") -> DraftTokens:
        pieces = [m.piece(t) for t in self.ids]
        self.session._draft = DraftState(self.ids, pieces, self.rows)
        return DraftTokens(tuple(pieces), tuple(self.logprobs), tuple(self.logits), self.finished)


def _prepare(sessions: Sequence[Any], prepare: Callable[[int, Any], None]) -> tuple[list[int], list[Any]]:
    """Run each session's own preparation; one that raises gets its exception, the others go on."""
    ready: list[int] = []
    out: list[Any] = [None] * len(sessions)
    for i, session in enumerate(sessions):
        try:
            prepare(i, session)
        except Exception as exc:
            out[i] = exc
            continue
        ready.append(i)
    return ready, out


class LlamaCppMember(LocalMember):
    """A GGUF model loaded once; serves up to ``slots`` sessions at a time."""

    capabilities = Capabilities(batched=True, prompt_fit=True)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        prompt: PromptFormat | None = None,
        n_ctx: int = 4096,
        n_batch: int = 512,
        threads: int | None = None,
        prefix_cache: bool = True,
        slots: int = 1,
        max_outputs: int = 64,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        self.path = Path(path)
        self.name = name or self.path.stem
        check_gguf(self.path)
        _init_backend()
        self.threads = threads or default_threads()
        self.prefix_cache = prefix_cache  # False only to measure the reference method
        self._model = _load_model(self.path)
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self.n_params = int(lc.llama_model_n_params(self._model))  # the gate's default leader is the largest
        self._ctx = self._create_context(n_ctx, n_batch, slots)
        self._mem = lc.llama_get_memory(self._ctx)
        self.slots = slots
        self.n_ctx = lc.llama_n_ctx(self._ctx) // slots  # one session's window
        self._free_slots = list(range(slots))
        self._slot_free = threading.Condition()
        self._init_batch(n_batch)
        self.max_outputs = max(1, max_outputs)  # logits rows one decode asks for (see decode)
        template = lc.llama_model_chat_template(self._model, None)
        self.chat_template = template.decode("utf-8") if template else None
        self.prompt = choose_format(prompt, self.chat_template, self.path.name)
        self._read_special_tokens()
        self._piece_cache: dict[int, bytes] = {}
        self.softmax = LogSoftmax(self.n_vocab)
        self._reserve_outputs()

    def _create_context(self, n_ctx: int, n_batch: int, slots: int) -> Any:
        """A context of `slots` windows of `n_ctx` tokens, 8 sequences per slot, in one unified cache."""
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx * slots
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = SEQS_PER_SESSION * slots
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.kv_unified = True  # candidate sequences share the prefix cells
        params.swa_full = True  # sliding-window layers must allow partial removal
        params.no_perf = True
        ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            lc.llama_model_free(self._model)
            detail = _log_excerpt()
            raise MemberLoadError(
                f"llama.cpp could not create a context of {slots} x {n_ctx} tokens for {self.path}"
                + (f" ({detail})" if detail else ""),
                "lower n_ctx or the number of concurrent sessions (max_concurrent)",
            )
        return ctx

    def _init_batch(self, n_batch: int) -> None:
        """One reused batch, its fields seen as NumPy arrays so that filling it is cheap."""
        self.n_batch = n_batch
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._batch_tokens = np.ctypeslib.as_array(self._batch.token, shape=(n_batch,))
        self._batch_pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_batch,))
        self._batch_nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_batch,))
        self._batch_logits = np.ctypeslib.as_array(self._batch.logits, shape=(n_batch,))
        self._batch_nseq[:] = 1

    def _read_special_tokens(self) -> None:
        """BOS/EOS texts for the chat template, and every end-of-generation token (EOS, EOT, <|im_end|>, ...)."""
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        bos, eos = lc.llama_vocab_bos(self._vocab), lc.llama_vocab_eos(self._vocab)
        self.bos_text = self._piece(bos, special=True).decode("utf-8", "replace") if bos >= 0 else ""
        self.eos_text = self._piece(eos, special=True).decode("utf-8", "replace") if eos >= 0 else ""
        is_eog, vocab = lc.llama_vocab_is_eog, self._vocab
        self.eog_ids = np.array([t for t in range(self.n_vocab) if is_eog(vocab, t)], dtype=np.int64)
        if not len(self.eog_ids):
            raise MemberLoadError(f"{self.path.name} declares no end-of-generation token", "use another model file")

    # --- tokens --------------------------------------------------------------
    def _piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def piece(self, token: int) -> bytes:
        """Text bytes of a token as it appears in an answer (control tokens are empty)."""
        cached = self._piece_cache.get(token)
        if cached is None:
            cached = b"" if self.is_eog(token) else self._piece(token)
            self._piece_cache[token] = cached
        return cached

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self._vocab, token))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (lc.llama_token * capacity)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (lc.llama_token * capacity)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def tokenize_plain(self, text: str) -> list[int]:
        return self.tokenize(text, add_special=False, parse_special=False)

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        if self.prompt.style == "plain":
            return self.tokenize(render_plain(messages), add_special=True, parse_special=False)
        assert self.chat_template is not None
        text = render_chat(self.chat_template, messages, self.bos_text, self.eos_text)
        has_bos = bool(self.bos_text) and text.startswith(self.bos_text)
        return self.tokenize(text, add_special=not has_bos, parse_special=True)

    # --- raw decoding --------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
               outputs: Sequence[bool]) -> np.ndarray:
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
                parts.append(self._decode_once(tokens[start:end], positions[start:end], seqs[start:end],
                                               flags[start:end]).copy())
                start, seen = end, 0
        return np.concatenate(parts)

    def _reserve_outputs(self) -> None:
        """Grow llama.cpp's logits buffer to ``max_outputs`` rows now, once, rather than in steps while serving."""
        n = min(self.max_outputs, self.n_batch, self.n_ctx)
        self._decode_once([0] * n, list(range(n)), [0] * n, [True] * n)
        lc.llama_memory_clear(self._mem, False)

    def _decode_once(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
                     outputs: Sequence[bool]) -> np.ndarray:
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
        status = lc.llama_decode(self._ctx, batch)
        if status == 1:
            raise PromptTooLongError(
                f"{self.name}: the context window ({self.n_ctx} tokens) is full",
                "shorten the prompt or lower --max-tokens",
            )
        if status != 0:
            raise MemberLoadError(f"{self.name}: llama_decode failed with status {status}", "see the log above")
        n_out = int(sum(1 for o in outputs if o))
        if n_out == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = lc.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        if not lc.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise MemberLoadError(f"{self.name}: cannot remove cache cells [{p0}, {p1}) of sequence {seq}",
                                  "this model's cache does not support partial removal")

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        lc.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    # --- sessions ------------------------------------------------------------
    def open_session(self, prompt: list[int], seed: int | None) -> "LlamaCppSession":
        with self._slot_free:  # with every slot taken, wait for a session to close (as a lock would)
            while not self._free_slots:
                self._slot_free.wait()
            if len(self._free_slots) == self.slots:
                # No other session: start from an empty cache, so the cells are used from the first one
                # on and attention spans only them (a lone request runs as with a single slot).
                lc.llama_memory_clear(self._mem, False)
            slot = self._free_slots.pop(0)
            self._clear_slot(slot)
        return LlamaCppSession(self, prompt, seed, slot=slot, reencode=not self.prefix_cache)

    @property
    def free_slots(self) -> int:
        with self._slot_free:
            return len(self._free_slots)

    def occupancy(self) -> Occupancy:
        """Slots free, and the cache positions every sequence holds (0 when no session is open).

        A cell shared by several sequences (a candidate copied from the context) counts once per
        sequence. Read it between decodes, from the thread that decodes.
        """
        if not self._ctx:
            return Occupancy(self.slots, self.free_slots, None)
        cells = 0
        for seq in range(SEQS_PER_SESSION * self.slots):
            last = lc.llama_memory_seq_pos_max(self._mem, seq)
            if last >= 0:
                cells += last - lc.llama_memory_seq_pos_min(self._mem, seq) + 1
        return Occupancy(self.slots, self.free_slots, cells)

    def _clear_slot(self, slot: int) -> None:
        for seq in range(slot * SEQS_PER_SESSION, (slot + 1) * SEQS_PER_SESSION):
            lc.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def release(self, slot: int = 0) -> None:
        self._clear_slot(slot)
        with self._slot_free:
            self._free_slots.append(slot)
            self._free_slots.sort()
            self._slot_free.notify()

    # --- many sessions at once --------------------------------------------------
    def draft_many(self, sessions: Sequence["LlamaCppSession"],
                   requests: Sequence[tuple[int, Sampling]]) -> list[DraftTokens | Exception]:
        """``draft`` for several sessions, one ``llama_decode`` per token step for all of them."""
        ready, out = _prepare(sessions, lambda i, s: s._sync())
        try:
            drafts = self._draft_batch([sessions[i] for i in ready], [requests[i] for i in ready])
        except Exception as exc:  # the decode failed for all of them
            drafts = [exc] * len(ready)
        for i, draft in zip(ready, drafts):
            out[i] = draft
        return out

    def _draft_batch(self, sessions: Sequence["LlamaCppSession"],
                     requests: Sequence[tuple[int, Sampling]]) -> list[DraftTokens]:
        drafting = [_Drafting(s, n, sampling, *s._prefix()) for s, (n, sampling) in zip(sessions, requests)]
        while True:
            feeding = [d for d in drafting if d.step(self)]
            if not feeding:
                break
            rows = self.decode([d.ids[-1] for d in feeding], [d.pos for d in feeding],
                               [d.session.base for d in feeding], [True] * len(feeding))
            for d, row in zip(feeding, rows):
                d.fed(row.copy(), self.softmax.lse(row))
        return [d.finish(self) for d in drafting]

    def score_many(self, sessions: Sequence["LlamaCppSession"],
                   texts: Sequence[tuple[Sequence[str]]]) -> list[list[TokenScores] | Exception]:
        """``score`` for several sessions: every session's new candidates in one batch (chunked at n_batch)."""
        plans: dict[int, _VerifyPlan] = {}

        def plan(i: int, session: "LlamaCppSession") -> None:
            plans[i] = session._plan_scores(list(texts[i][0]))

        ready, out = _prepare(sessions, plan)
        chunk: list[_VerifyPlan] = []
        try:
            for i in ready:
                if sum(len(q.tokens) for q in chunk) + len(plans[i].tokens) > self.n_batch:
                    self._verify_batch(chunk)
                    chunk = []
                chunk.append(plans[i])
            self._verify_batch(chunk)
            for i in ready:
                out[i] = plans[i].answer()
        except Exception as exc:
            for i in ready:
                out[i] = exc
        return out

    def _verify_batch(self, plans: Sequence["_VerifyPlan"]) -> None:
        """Decode the candidates of several sessions in one batch and hand each its rows."""
        plans = [p for p in plans if p.tokens]
        if not plans:
            return
        tokens = [t for p in plans for t in p.tokens]
        rows = self.decode(tokens, [x for p in plans for x in p.positions], [x for p in plans for x in p.seqs],
                           [True] * len(tokens))
        at = 0
        for p in plans:
            p.session._finish_verify(p, rows[at : at + len(p.tokens)])
            at += len(p.tokens)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            lc.llama_model_free(self._model)
            self._ctx = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


class LlamaCppSession(CachedSession):
    """One request's context on a LlamaCppMember: sequence ``base`` of the cache and the
    candidate sequences after it. See the module docstring.

    With ``reencode=True`` the session behaves like the paper's reference code
    (every draft and every verification re-encodes the whole context); it
    exists only so the benchmark can measure what the cache saves.
    """

    m: LlamaCppMember
    _verified: dict[str, _InSequence]  # type: ignore[assignment]

    def __init__(self, member: LlamaCppMember, prompt: list[int], seed: int | None,
                 slot: int = 0, reencode: bool = False) -> None:
        super().__init__(member, prompt)
        self.slot = slot
        self.base = slot * SEQS_PER_SESSION  # this session's sequence 0; its candidates follow
        self.reencode = reencode
        self._next_lse: float | None = None
        self.rng = np.random.default_rng(seed)
        self._closed = False

    def _set_next(self, row: np.ndarray | None) -> None:
        self._next_row, self._next_lse = row, None

    def _prefix(self) -> tuple[np.ndarray, float]:
        """Logits after the cached context and their log-sum-exp (computed once)."""
        assert self._next_row is not None
        if self._next_lse is None:
            self._next_lse = self.m.softmax.lse(self._next_row)
        return self._next_row, self._next_lse

    def _sync(self) -> None:
        m = self.m
        if self.reencode:  # reference behaviour: forget the cache, encode everything again
            m._clear_slot(self.slot)
            self.n_cached = 0
            self._set_next(None)
            self._draft, self._verified = None, {}  # nothing carries over from drafting to verifying
        start = self.n_cached
        while self.n_cached < len(self.tokens):
            chunk = self.tokens[self.n_cached : self.n_cached + m.n_batch]
            pos = list(range(self.n_cached, self.n_cached + len(chunk)))
            last = self.n_cached + len(chunk) == len(self.tokens)
            rows = m.decode(chunk, pos, [self.base] * len(chunk), [False] * (len(chunk) - 1) + [last])
            self.stats.decode_calls += 1
            self.n_cached += len(chunk)
            if last:
                self._set_next(rows[0].copy())
        self._count_synced(start)
        if self._next_row is None:
            raise RuntimeError("context is empty")

    def _sample(self, row: np.ndarray, sampling: Sampling) -> int:
        if sampling.greedy:
            token = int(row.argmax())
            if sampling.ignore_eos and self.m.is_eog(token):
                masked = row.copy()
                masked[self.m.eog_ids] = -np.inf
                token = int(masked.argmax())
            return token
        p = self.m.softmax.probs(row, sampling.temperature)
        if sampling.ignore_eos:
            p[self.m.eog_ids] = 0.0
        if sampling.top_p >= 1.0:
            idx = None
        else:
            # The nucleus lies among tokens above a small floor whenever their mass
            # reaches top_p: sort those few instead of the whole vocabulary.
            idx = np.flatnonzero(p >= 1e-5)
            if float(p[idx].sum()) < sampling.top_p:
                idx = np.arange(len(p))
            idx = idx[np.argsort(-p[idx], kind="stable")]
            cum = np.cumsum(p[idx])
            keep = min(int(np.searchsorted(cum, sampling.top_p)) + 1, len(idx))
            idx = idx[:keep]
        weights = p if idx is None else p[idx]
        cum = np.cumsum(weights)
        pick = min(int(np.searchsorted(cum, self.rng.random() * cum[-1], "right")), len(cum) - 1)
        return pick if idx is None else int(idx[pick])

    def draft(self, max_tokens: int, sampling: Sampling) -> DraftTokens:
        self._sync()
        return self.m._draft_batch([self], [(max_tokens, sampling)])[0]

    def _verify(self, texts: list[str]) -> dict[str, TokenScores]:
        plan = _VerifyPlan(self, texts, {}, texts)
        self._lay_out(plan)
        self.m._verify_batch([plan])
        return plan.results

    def _plan_scores(self, texts: list[str]) -> "_VerifyPlan":
        """What verifying `texts` needs (for a batch of sessions): known scores, the new candidates laid out."""
        known, pending = self._known(texts)
        plan = _VerifyPlan(self, texts, known, pending)
        self._lay_out(plan)
        return plan

    def _lay_out(self, plan: "_VerifyPlan") -> None:
        """Each pending candidate in a sequence of its own, after a copy of the context's cells."""
        if len(plan.pending) + len(self._verified) > MAX_CANDIDATES:
            raise ValueError(f"at most {MAX_CANDIDATES} distinct candidates per round")
        m, n_prefix = self.m, len(self.tokens)
        plan.encoded = [m.encode_continuation(t) for t in plan.pending]
        total = sum(len(ids) for ids in plan.encoded)
        if total > m.n_batch or n_prefix + total > m.n_ctx:
            raise PromptTooLongError(f"{m.name}: the candidates do not fit the context", "lower --window")
        for i, ids in enumerate(plan.encoded):
            seq = self.base + 1 + len(self._verified) + i
            m.seq_cp(self.base, seq, 0, n_prefix)
            plan.tokens += ids
            plan.positions += range(n_prefix, n_prefix + len(ids))
            plan.seqs += [seq] * len(ids)

    def text_logprob(self, text: str, max_tokens: int = 256) -> tuple[float, int]:
        """How well this member predicts `text` on its own (prompt-fit weights).

        Returns the summed natural-log probability of the first `max_tokens`
        tokens of `text` after a newline (and BOS where the model uses one),
        and the number of bytes they spell. Runs in a spare sequence of the
        cache, before any candidate is verified; the session's context is
        untouched.
        """
        m = self.m
        if self._verified:
            raise RuntimeError("text_logprob must run before candidates are verified")
        anchor = m.tokenize("\n", add_special=True, parse_special=False)
        ids = m.encode_continuation(text)[:max_tokens]
        if not ids:
            return 0.0, 0
        seq, tokens = self.base + 1, anchor + ids
        total, at, chunk = 0.0, 0, 64
        try:
            while at < len(tokens) - 1:
                part = tokens[at : at + chunk]
                rows = m.decode(part, list(range(at, at + len(part))), [seq] * len(part), [True] * len(part))
                self.stats.decode_calls += 1
                for r, row in enumerate(rows):
                    target = at + r + 1  # row r predicts the token after part[r]
                    if len(anchor) <= target < len(tokens):
                        total += float(row[tokens[target]]) - m.softmax.lse(row)
                at += len(part)
        finally:
            m.seq_rm(seq, -1, -1)
        return total, len(b"".join(m.piece(t) for t in ids))

    def _end_score(self) -> TokenScores:
        """The candidate "stop here": probability of any end-of-generation token."""
        row, lse = self._prefix()
        eog = row[self.m.eog_ids]
        top = float(eog.max())
        logprob = top + math.log(float(np.exp(eog - top).sum())) - lse
        return TokenScores((logprob,), (top,), (float(row.max()) - lse,))

    def _finish_verify(self, plan: "_VerifyPlan", rows: np.ndarray) -> None:
        """Scores of the planned candidates from their decoded rows (row r predicts the token after r)."""
        m = self.m
        prefix_row, prefix_lse = self._prefix()
        self.stats.verify += len(plan.tokens)
        self.stats.verify_calls += 1
        self.stats.decode_calls += 1
        # Each candidate's first token is predicted by the prefix row.
        at = 0
        for text, ids in zip(plan.pending, plan.encoded):
            logprobs, logits, tops = [], [], []
            for i, token in enumerate(ids):
                row, lse = (prefix_row, prefix_lse) if i == 0 else (rows[at + i - 1], None)
                lse = lse if lse is not None else m.softmax.lse(row)
                logit = float(row[token])
                logits.append(logit)
                logprobs.append(logit - lse)
                tops.append(float(row.max()) - lse)
            scores = TokenScores(tuple(logprobs), tuple(logits), tuple(tops))
            seq = plan.seqs[at]
            self._verified[text] = _InSequence(ids, scores, rows[at + len(ids) - 1].copy(), seq)
            plan.results[text] = scores
            at += len(ids)

    def _truncate(self, length: int) -> None:
        self.m.seq_rm(self.base, length, -1)

    def _adopt(self, candidate: Verified, n_prefix: int) -> None:
        assert isinstance(candidate, _InSequence)
        self.m.seq_cp(candidate.seq, self.base, n_prefix, -1)

    def _drop_candidates(self) -> None:
        for candidate in self._verified.values():
            self.m.seq_rm(candidate.seq, -1, -1)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.m.release(self.slot)


def load(target: str, *, cache_dir: str | None = None, **options: object) -> LlamaCppMember:
    """Registry entry: a known model name or a GGUF path."""
    from ..models import resolve

    name, path, prompt = resolve(target, cache_dir)
    return LlamaCppMember(path, name=name, prompt=prompt, **options)  # type: ignore[arg-type]
