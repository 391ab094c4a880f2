"""llama.cpp members through llama-cpp-python's low-level API.

KV-cache layout per session (docs/design.md#prefix-caching):
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

Between requests (``prefix_cache_cells``): the context holds that many cells
more, and each prefix-cache entry (``prefix_cache.py``) is one sequence after
the sessions'. A closing session's context is copied into an entry (cells are
shared, not copied); a new session copies the longest matching prefix from an
entry into its sequence 0 and decodes only the rest of its prompt.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
from pydantic import Field

from ..errors import MemberLoadError, NoFreeSlotError, PromptTooLongError
from ..models import PromptFormat, check_gguf
from ..prompting import choose_format, raw_prompt, render_chat, render_plain
from ..types import DraftTokens, Message, Sampling, TokenScores
from .base import Capabilities, Occupancy
from .cached import LocalMember
from ..member_options import MemberOptions
from .llama_runtime import (LogSoftmax, default_threads, gpu_layers_for, init_backend, load_model, log_excerpt,
                            offloaded_layers, placement, side_by_side_for, threads_for)
from .llama_session import SEQS_PER_SESSION, Drafting, LlamaCppSession, VerifyPlan
from .prefix_cache import PrefixCache
from .spec import split_target
from .special_text import Special, SpecialTexts, protected_pieces

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
# How long opening a session waits for a slot another thread's session holds. Sessions are closed by
# whoever opened them, so in one thread (the server's worker) a wait cannot end: fail clearly instead.
SLOT_WAIT_S = 30.0

__all__ = ["LlamaCppMember", "LlamaCppSession", "default_threads", "load"]


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

    capabilities = Capabilities(batched=True, prompt_fit=True, constrained=True)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        prompt: PromptFormat | None = None,
        n_ctx: int = 4096,
        n_batch: int = 512,
        threads: int | None = None,
        reencode: bool = False,
        slots: int = 1,
        max_outputs: int = 64,
        prefix_cache_cells: int | None = None,
        gpu_layers: int | None = None,
        main_gpu: int = 0,
        split: str = "layer",
        tensor_split: tuple[float, ...] | None = None,
        side_by_side: str | None = None,
    ) -> None:
        """`prefix_cache_cells`: cells kept between requests (None: ``n_ctx * slots``; 0: off).
        `reencode`: every call re-encodes the whole context, as the paper's reference code (benchmarks only).
        `gpu_layers`: layers offloaded (None: all where llama.cpp can offload, else none; -1: all), on
        `main_gpu`, or spread over the GPUs by `split` ("layer", "row"; "none": main_gpu only) in
        `tensor_split` shares. `side_by_side`: "on", "off", or "auto"/None (on when every layer is on a GPU):
        whether its calls run in a thread of their own beside the other members'."""
        if slots < 1:
            raise ValueError("slots must be at least 1")
        if prefix_cache_cells is not None and prefix_cache_cells < 0:
            raise ValueError("prefix_cache_cells must be 0 (off) or more")
        self.path = Path(path)
        self.name = name or self.path.stem
        check_gguf(self.path)
        init_backend()
        self.reencode = reencode
        cells = n_ctx * slots if prefix_cache_cells is None else prefix_cache_cells
        entries = min(max(4, 2 * slots), MAX_SEQUENCES - SEQS_PER_SESSION * slots) if cells and not reencode else 0
        cells = cells if entries > 0 else 0
        self._model, self.model_params = load_model(self.path, gpu_layers=gpu_layers_for(gpu_layers),
                                                    main_gpu=main_gpu, split=split, tensor_split=tensor_split)
        total = lc.llama_model_n_layer(self._model) + 1  # llama.cpp counts the output layer as one more
        self.gpu_layers = offloaded_layers(self.model_params["n_gpu_layers"], total - 1)
        self.placement = placement(self.gpu_layers, total, main_gpu, split)
        self.threads = threads_for(threads, total - self.gpu_layers)
        self.capabilities = Capabilities(batched=True, prompt_fit=True, constrained=True,
                                         parallel_safe=side_by_side_for(side_by_side, self.gpu_layers, total))
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = self.vocab_size = lc.llama_vocab_n_tokens(self._vocab)
        self.n_params = int(lc.llama_model_n_params(self._model))  # the gate's default leader is the largest
        self._ctx = self._create_context(n_ctx, n_batch, slots, cells, entries)
        self._mem = lc.llama_get_memory(self._ctx)
        self.slots = slots
        self.n_ctx = (lc.llama_n_ctx(self._ctx) - cells) // slots  # one session's window
        first = SEQS_PER_SESSION * slots
        self._entry_seqs = range(first, first + entries)
        self.prefix_cache: PrefixCache[int] = PrefixCache(cells, self._entry_seqs,
                                                          lambda seq: self.seq_rm(seq, -1, -1))
        self._free_slots = list(range(slots))
        self._slot_free = threading.Condition()
        self.slot_wait_s = SLOT_WAIT_S
        self._init_batch(n_batch)
        self.max_outputs = max(1, max_outputs)  # logits rows one decode asks for (see decode)
        template = lc.llama_model_chat_template(self._model, None)
        self.chat_template = template.decode("utf-8") if template else None
        self.prompt = choose_format(prompt, self.chat_template, self.path.name)
        self._read_special_tokens()
        self._piece_cache: dict[int, bytes] = {}
        self.softmax = LogSoftmax(self.n_vocab)
        self._reserve_outputs()

    def _create_context(self, n_ctx: int, n_batch: int, slots: int, cached: int, entries: int) -> Any:
        """A context of `slots` windows of `n_ctx` tokens, 8 sequences per slot, and `cached` cells in
        `entries` sequences for the prefix cache, in one unified cache."""
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx * slots + cached
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = SEQS_PER_SESSION * slots + entries
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        params.kv_unified = True  # candidate sequences share the prefix cells
        params.swa_full = True  # sliding-window layers must allow partial removal
        params.no_perf = True
        ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            lc.llama_model_free(self._model)
            detail = log_excerpt()
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
        self.add_eos = bool(lc.llama_vocab_get_add_eos(self._vocab))
        is_eog, vocab = lc.llama_vocab_is_eog, self._vocab
        self.eog_ids = np.array([t for t in range(self.n_vocab) if is_eog(vocab, t)], dtype=np.int64)
        if not len(self.eog_ids):
            raise MemberLoadError(f"{self.path.name} declares no end-of-generation token", "use another model file")
        # The tokens that special parsing makes of their text (user-defined ones are matched either way).
        get_attr, special = lc.llama_vocab_get_attr, lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN
        attrs = [(t, get_attr(vocab, t)) for t in range(self.n_vocab)]
        self.specials = SpecialTexts(
            Special(self._piece(t, special=True).decode("utf-8", "replace"), t,
                    bool(a & lc.LLAMA_TOKEN_ATTR_LSTRIP), bool(a & lc.LLAMA_TOKEN_ATTR_RSTRIP))
            for t, a in attrs if a & special)

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
        if (raw := raw_prompt(messages)) is not None:  # a text completion: as llama.cpp's server reads it
            has_bos = bool(self.bos_text) and raw.startswith(self.bos_text)
            return self.tokenize(raw, add_special=not has_bos, parse_special=True)
        if self.prompt.style == "plain":
            return self.tokenize(render_plain(messages), add_special=True, parse_special=False)
        text = self._render(messages)
        has_bos = bool(self.bos_text) and text.startswith(self.bos_text)
        if not self.specials.spelled_in(m.content for m in messages):
            return self.tokenize(text, add_special=not has_bos, parse_special=True)
        return self.protected_tokens(messages, text, add_special=not has_bos)

    def _render(self, messages: Sequence[Message]) -> str:
        assert self.chat_template is not None
        return render_chat(self.chat_template, messages, self.bos_text, self.eos_text)

    def protected_tokens(self, messages: Sequence[Message], text: str, *, add_special: bool) -> list[int]:
        """`text` (the templated `messages`) tokenized with the template's special tokens, and the
        messages' contents as plain text (a content that spells ``<|im_start|>`` stays those characters).
        For ordinary contents the same ids as tokenizing `text` whole (``special_text.py``)."""
        ids = [lc.llama_vocab_bos(self._vocab)] if add_special and self.add_bos else []
        for piece in protected_pieces(self.name, self._render, messages, text, self.specials):
            ids += [piece] if isinstance(piece, int) else self.tokenize(piece, add_special=False,
                                                                         parse_special=False)
        return ids + ([lc.llama_vocab_eos(self._vocab)] if add_special and self.add_eos else [])

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
        while status == 1 and self.prefix_cache.evict_one():  # no room: cached prefixes give way first
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
    def open_session(self, prompt: list[int], seed: int | None, cache_salt: str | None = None) -> "LlamaCppSession":
        slot = self._take_slot()
        try:
            session = LlamaCppSession(self, prompt, seed, slot=slot, reencode=self.reencode)
            session.cache_salt = cache_salt
            session.n_cached = session.stats.reused = self._reuse_prefix(prompt, session.base, cache_salt)
        except BaseException:
            self.release(slot)  # the session never opened: its slot is free again, with nothing to keep
            raise
        return session

    def _take_slot(self) -> int:
        """A free slot, cleared; with every slot taken, wait up to ``slot_wait_s`` for a session to close."""
        with self._slot_free:
            if not self._slot_free.wait_for(lambda: bool(self._free_slots), self.slot_wait_s):
                raise NoFreeSlotError(
                    f"no free slot on member {self.name} within {self.slot_wait_s:g} s "
                    f"(all {self.slots} are held by open sessions)",
                    "retry later, or load the member with more slots (max_concurrent)")
            if len(self._free_slots) == self.slots and not self.prefix_cache.handles:
                # No other session and nothing cached: start from an empty cache, so the cells are used
                # from the first one on and attention spans only them (a lone request runs as with a
                # single slot).
                lc.llama_memory_clear(self._mem, False)
            slot = self._free_slots.pop(0)
            self._clear_slot(slot)
            return slot

    def _reuse_prefix(self, prompt: list[int], seq: int, salt: str | None = None) -> int:
        """Copy the longest prefix of `prompt` cached under `salt` into sequence `seq`; how many tokens
        it covers.

        At least the prompt's last token is left to decode: its logits row starts the answer.
        """
        cache = self.prefix_cache
        with cache.lock:
            found = cache.lookup(prompt, len(prompt) - 1, salt)
            if found is None:
                return 0
            entry, length = found
            self.seq_cp(entry, seq, 0, length)
            return length

    def keep_prefix(self, seq: int, tokens: list[int], salt: str | None = None) -> None:
        """Keep the cells of `tokens`, held by sequence `seq` from position 0, in the prefix cache
        (under `salt`)."""
        def copy(entry: int, n: int) -> None:
            self.seq_rm(entry, -1, -1)
            self.seq_cp(seq, entry, 0, n)

        self.prefix_cache.store(tokens, copy, salt)

    @property
    def free_slots(self) -> int:
        with self._slot_free:
            return len(self._free_slots)

    def occupancy(self) -> Occupancy:
        """Slots free; the cache positions open sessions hold (0 when none is open); the prefix cache;
        and stray positions: held by a free slot, by no live entry, or by an entry beyond its tokens.

        A cell shared by several sequences (a candidate copied from the context, a prefix kept
        between requests) counts once per sequence. Read it between decodes, from the thread that
        decodes.
        """
        if not self._ctx:
            return Occupancy(self.slots, self.free_slots, None)
        with self._slot_free:
            free = set(self._free_slots)
        entries = self.prefix_cache.lengths()
        held = stray = 0
        for seq in range(SEQS_PER_SESSION * self.slots):
            cells = self._seq_cells(seq)
            held, stray = (held, stray + cells) if seq // SEQS_PER_SESSION in free else (held + cells, stray)
        for seq in self._entry_seqs:
            stray += abs(self._seq_cells(seq) - entries.get(seq, 0))
        return Occupancy(self.slots, len(free), held, stray, self.prefix_cache.stats())

    def _seq_cells(self, seq: int) -> int:
        last = lc.llama_memory_seq_pos_max(self._mem, seq)
        return last - lc.llama_memory_seq_pos_min(self._mem, seq) + 1 if last >= 0 else 0

    def _clear_slot(self, slot: int) -> None:
        for seq in range(slot * SEQS_PER_SESSION, (slot + 1) * SEQS_PER_SESSION):
            lc.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def release(self, slot: int = 0, keep: list[int] | None = None, salt: str | None = None) -> None:
        """Free `slot`; `keep`: the tokens its sequence 0 holds from position 0, for the prefix cache
        (under `salt`).

        The slot is free again whatever fails on the way (keeping the prefix is a favour to later requests)."""
        try:
            if keep:
                self.keep_prefix(slot * SEQS_PER_SESSION, keep, salt)
        finally:
            try:
                self._clear_slot(slot)
            finally:
                with self._slot_free:
                    if slot not in self._free_slots:
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
        # A request is draft's positional arguments: (n, sampling) or (n, sampling, on_text).
        drafting = [Drafting(s, n, sampling, *s._prefix(), *hook)
                    for s, (n, sampling, *hook) in zip(sessions, requests)]
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
        plans: dict[int, VerifyPlan] = {}

        def plan(i: int, session: "LlamaCppSession") -> None:
            plans[i] = session._plan_scores(list(texts[i][0]))

        ready, out = _prepare(sessions, plan)
        chunk: list[VerifyPlan] = []
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

    def _verify_batch(self, plans: Sequence["VerifyPlan"]) -> None:
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


class LlamaCppOptions(MemberOptions):
    """A llama.cpp member's options: every member's, and those only a spec's ``#key=value`` gives."""

    name: str | None = None
    n_batch: int | None = Field(None, ge=1)
    max_outputs: int | None = Field(None, ge=1)


def load(target: str, shared: MemberOptions | None = None) -> LlamaCppMember:
    """Registry entry: a known model name or a GGUF path, optionally followed by
    ``#NAME,KEY=VALUE,...`` (LlamaCppOptions' fields, over the ensemble's `shared` options)."""
    from ..models import resolve

    head, spec = split_target(target, LlamaCppOptions.model_fields, "llama_cpp")
    options = (shared or MemberOptions()).merged(LlamaCppOptions, spec, where=f"member {target!r}")
    given = options.given()
    cache_dir = given.pop("cache_dir", None)
    name, path, prompt = resolve(head, cache_dir)
    given.setdefault("name", name)
    member = LlamaCppMember(path, prompt=prompt, **given)
    member.options = options
    return member
