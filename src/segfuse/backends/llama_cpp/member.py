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

The member puts together one job per module: ``runtime.py`` loads the
weights, ``vocab.py`` tokenizes, ``context.py`` decodes into the
cache's sequences, ``slots.py`` keeps the book of slots and cached
prefixes, ``batch.py`` runs several sessions' drafts and verifications in
shared decodes, and ``session.py`` is one request's context.

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

A deterministic session (``deterministic=True``) runs in a context of its own instead
(``private.py``): it reads no cached prefix, keeps none, and shares no decode.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
from pydantic import Field

from ...errors import MemberLoadError
from ...member_options import MemberOptions
from ...models import PromptFormat, check_gguf
from ...types import DraftTokens, Message, PromptToken, TokenScores
from ..base import Capabilities, Occupancy
from ..cached import LocalMember
from ..spec import split_target
from . import batch
from .context import LlamaContext
from .echo import echo_tokens
from .private import PrivateContexts
from .runtime import (
    LogSoftmax,
    default_threads,
    gpu_layers_for,
    init_backend,
    load_model,
    offloaded_layers,
    placement,
    side_by_side_for,
    threads_for,
)
from .session import LlamaCppSession
from .slots import SEQS_PER_SESSION, SlotTable, prefix_entries
from .vocab import LlamaVocab

__all__ = ["LlamaCppMember", "LlamaCppSession", "default_threads", "load"]


class LlamaCppMember(LocalMember):
    """A GGUF model loaded once; serves up to ``slots`` sessions at a time."""

    capabilities = Capabilities(batched=True, prompt_fit=True, constrained=True, echo=True)

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
        self.reencode, self.slots = reencode, slots
        self._load(gpu_layers, main_gpu, split, tensor_split, threads, side_by_side)
        self.vocab = LlamaVocab(self._model, self.name, self.path, prompt)
        self.n_vocab = self.vocab_size = self.vocab.n_vocab
        self.eog_ids, self.prompt, self.chat_template = self.vocab.eog_ids, self.vocab.prompt, self.vocab.chat_template
        self.bos_text, self.eos_text = self.vocab.bos_text, self.vocab.eos_text
        cells = n_ctx * slots if prefix_cache_cells is None else prefix_cache_cells
        entries = prefix_entries(slots, cells, reencode)
        cells = cells if entries > 0 else 0
        self.context = self._open_context(n_ctx, n_batch, max_outputs, cells, entries)
        self.n_ctx = (self.context.n_cells - cells) // slots  # one session's window
        self.context.window = self.n_ctx
        self.table = SlotTable(self.context, name=self.name, slots=slots, cells=cells, entries=entries)
        self.prefix_cache = self.table.prefix_cache
        self.context.make_room = self.prefix_cache.evict_one  # no room: cached prefixes give way first
        self.softmax = LogSoftmax(self.n_vocab)
        self.context.reserve_outputs(self.n_ctx)
        self.private = PrivateContexts(self._open_private)

    def _load(self, gpu_layers: int | None, main_gpu: int, split: str, tensor_split: tuple[float, ...] | None,
              threads: int | None, side_by_side: str | None) -> None:
        """The weights, where they run, the threads for what stays on the CPU, and whether to run side by side."""
        self._model, self.model_params = load_model(self.path, gpu_layers=gpu_layers_for(gpu_layers),
                                                    main_gpu=main_gpu, split=split, tensor_split=tensor_split)
        total = lc.llama_model_n_layer(self._model) + 1  # llama.cpp counts the output layer as one more
        self.gpu_layers = offloaded_layers(self.model_params["n_gpu_layers"], total - 1)
        self.placement = placement(self.gpu_layers, total, main_gpu, split)
        self.threads = threads_for(threads, total - self.gpu_layers)
        self.capabilities = Capabilities(batched=True, prompt_fit=True, constrained=True, echo=True,
                                         parallel_safe=side_by_side_for(side_by_side, self.gpu_layers, total))
        self.n_params = int(lc.llama_model_n_params(self._model))  # the gate's default leader is the largest

    def _open_context(self, n_ctx: int, n_batch: int, max_outputs: int, cells: int, entries: int) -> LlamaContext:
        """A context of `slots` windows of `n_ctx` tokens, 8 sequences per slot, and `cells` cells in
        `entries` sequences for the prefix cache, in one unified cache."""
        try:
            return LlamaContext(self._model, name=self.name, n_ctx=n_ctx * self.slots + cells, n_batch=n_batch,
                                n_seq=SEQS_PER_SESSION * self.slots + entries, threads=self.threads,
                                n_vocab=self.n_vocab, max_outputs=max_outputs, window=n_ctx,
                                shape=f"{self.slots} x {n_ctx} tokens for {self.path}")
        except MemberLoadError:
            lc.llama_model_free(self._model)
            raise

    def _open_private(self) -> LlamaContext:
        """A context for one deterministic session: its sequences, the shared context's batch size, and one
        window plus a batch of cells (a round's candidates, at most a batch, sit beside the context)."""
        ctx = LlamaContext(self._model, name=self.name, n_ctx=self.n_ctx + self.n_batch, n_batch=self.n_batch,
                           n_seq=SEQS_PER_SESSION,
                           threads=self.threads, n_vocab=self.n_vocab, max_outputs=self.max_outputs, window=self.n_ctx,
                           shape=f"{self.n_ctx} tokens for {self.path} (a deterministic session's own)")
        ctx.reserve_outputs(self.n_ctx)
        return ctx

    # --- tokens (the vocabulary's) ----------------------------------------------
    def piece(self, token: int) -> bytes:
        """Text bytes of a token as it appears in an answer (control tokens are empty)."""
        return self.vocab.piece(token)

    def special_piece(self, token: int) -> bytes:
        """A token's text as special parsing reads it (a control token spells its markup)."""
        return self.vocab.special_piece(token)

    def is_eog(self, token: int) -> bool:
        return self.vocab.is_eog(token)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def tokenize_plain(self, text: str) -> list[int]:
        return self.vocab.tokenize(text, add_special=False, parse_special=False)

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
        return self.vocab.prompt_tokens(messages)

    def lead_tokens(self) -> list[int]:
        return [self.vocab.bos] if self.vocab.add_bos and self.vocab.bos >= 0 else []

    def echo(self, prompt: str | Sequence[int], top_k: int = 0) -> list[PromptToken]:
        ids = self.tokenize_plain(prompt) if isinstance(prompt, str) else list(prompt)
        return echo_tokens(self, ids, top_k)

    def render(self, messages: Sequence[Message]) -> str:
        """`messages` through the model's chat template."""
        return self.vocab.render(messages)

    def protected_tokens(self, messages: Sequence[Message], text: str, *, add_special: bool) -> list[int]:
        """See :meth:`LlamaVocab.protected_tokens`."""
        return self.vocab.protected_tokens(messages, text, add_special=add_special)

    # --- decoding (the context's) --------------------------------------------------
    @property
    def n_batch(self) -> int:
        return self.context.n_batch

    @property
    def max_outputs(self) -> int:
        """Logits rows one decode asks for at most (see :meth:`LlamaContext.decode`)."""
        return self.context.max_outputs

    @max_outputs.setter
    def max_outputs(self, rows: int) -> None:
        self.context.max_outputs = max(1, rows)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
               outputs: Sequence[bool]) -> np.ndarray:
        """Decode one batch; the logits rows of tokens with an output flag (:meth:`LlamaContext.decode`)."""
        return self.context.decode(tokens, positions, seqs, outputs)

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.context.seq_rm(seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.context.seq_cp(src, dst, p0, p1)

    # --- sessions and slots (the slot table's) ----------------------------------------
    def open_session(self, prompt: list[int], seed: int | None, cache_salt: str | None = None,
                     deterministic: bool = False) -> LlamaCppSession:
        slot = self.table.take()  # a deterministic session's too: the slots bound the sessions open at once
        own = None
        try:
            own = self.private.take() if deterministic else None
            session = LlamaCppSession(self, prompt, seed, slot=slot, reencode=self.reencode, own=own)
            session.cache_salt = cache_salt
            if own is None:
                session.n_cached = session.stats.reused = self.table.reuse_prefix(prompt, session.base, cache_salt)
        except BaseException:
            if own is not None:
                self.private.give_back(own)
            self.release(slot)  # the session never opened: its slot is free again, with nothing to keep
            raise
        return session

    @property
    def slot_wait_s(self) -> float:
        """How long opening a session waits for a slot another thread's session holds."""
        return self.table.wait_s

    @slot_wait_s.setter
    def slot_wait_s(self, seconds: float) -> None:
        self.table.wait_s = seconds

    @property
    def free_slots(self) -> int:
        return self.table.free

    def clear_slot(self, slot: int) -> None:
        """Drop every cell of `slot`'s sequences."""
        self.table.clear(slot)

    def keep_prefix(self, seq: int, tokens: list[int], salt: str | None = None) -> None:
        """Keep the cells of `tokens`, held by sequence `seq` from position 0, in the prefix cache."""
        self.table.keep_prefix(seq, tokens, salt)

    def release(self, slot: int = 0, keep: list[int] | None = None, salt: str | None = None) -> None:
        """Free `slot`; `keep`: the tokens its sequence 0 holds from position 0, for the prefix cache
        (under `salt`).

        The slot is free again whatever fails on the way (keeping the prefix is a favour to later requests)."""
        try:
            if keep:
                self.keep_prefix(self.table.base(slot), keep, salt)
        finally:
            self.table.release(slot)

    def occupancy(self) -> Occupancy:
        seen = self.table.occupancy()
        if seen.cache_cells is None or seen.stray_cells is None:
            return seen
        held, stray = self.private.cells()  # deterministic sessions' own contexts
        return replace(seen, cache_cells=seen.cache_cells + held, stray_cells=seen.stray_cells + stray)

    # --- many sessions at once (batch.py) ------------------------------------------
    def draft_many(self, sessions: Sequence[LlamaCppSession],  # type: ignore[override]
                   requests: Sequence[tuple[Any, ...]]) -> list[DraftTokens | Exception]:
        """``draft`` for several sessions, one ``llama_decode`` per token step for all of them."""
        return batch.draft_many(self, sessions, requests)

    def score_many(self, sessions: Sequence[LlamaCppSession],  # type: ignore[override]
                   texts: Sequence[tuple[Sequence[str]]]) -> list[list[TokenScores] | Exception]:
        """``score`` for several sessions: every session's new candidates in one batch (chunked at n_batch)."""
        return batch.score_many(self, sessions, texts)

    def close(self) -> None:
        if getattr(self, "context", None) is not None and self.context.is_open:
            self.private.close()
            self.context.close()
            lc.llama_model_free(self._model)

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
    from ...models import resolve

    head, spec = split_target(target, LlamaCppOptions.model_fields, "llama_cpp")
    options = (shared or MemberOptions()).merged(LlamaCppOptions, spec, where=f"member {target!r}")
    given = options.given()
    cache_dir = given.pop("cache_dir", None)
    name, path, prompt = resolve(head, cache_dir)
    given.setdefault("name", name)
    member = LlamaCppMember(path, prompt=prompt, **given)
    member.options = options
    return member
