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

The member puts together one part per module and implements the protocol with
them: ``runtime.py`` loads the weights (and holds the log-softmax),
``vocab.py`` tokenizes (:class:`Vocabulary`), ``context.py`` decodes into the
cache's sequences (:class:`Context`), ``slots.py`` keeps the book of slots and
cached prefixes (:class:`Slots`), ``private.py`` the contexts of deterministic
sessions; ``session.py`` is one request's context, ``batch.py`` runs several
sessions' drafts and verifications in shared decodes, and ``echo.py`` reads a
whole text. Sessions, batches and echo are given the parts they use, never the
member.

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

Across runs (``prefix_cache_dir``): the entries are written to a directory when the member
closes or is asked (``save_prefix_cache``), and read back when a session's prompt finds a
longer prefix there than in memory (``persist.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import llama_cpp as lc
from pydantic import Field

from ...errors import MemberLoadError
from ...member_options import MemberOptions
from ...models import PromptFormat, check_gguf
from ...types import DraftTokens, PromptToken, TokenScores
from ..base import Capabilities, Occupancy
from ..cached import LocalMember
from ..compute import compute_here
from ..spec import split_target
from . import batch
from .context import Context, KvCache, layout
from .echo import echo_tokens
from .persist import open_disk, settings_of, state_per_token
from .private import PrivateContexts
from .runtime import (
    COMPUTE,
    LogSoftmax,
    allocations,
    gpu_layers_for,
    init_backend,
    load_model,
    offloaded_layers,
    placement,
    side_by_side_for,
    threads_for,
)
from .session import LlamaCppSession
from .slots import SEQS_PER_SESSION, Slots, prefix_entries
from .vocab import Vocabulary

__all__ = ["LlamaCppMember", "LlamaCppOptions", "load"]
log = logging.getLogger("segfuse.backends.prefix_cache")


class LlamaCppMember(LocalMember):
    """A GGUF model loaded once; serves up to ``slots`` sessions at a time."""

    capabilities = Capabilities(batched=True, prompt_fit=True, constrained=True, echo=True, speculates=True)
    vocab: Vocabulary
    slots: int  # always known here
    options: MemberOptions | None = None  # what load() made it with

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
        prefix_cache_dir: str | os.PathLike[str] | None = None,
        prefix_cache_dir_max_bytes: int | None = None,
        type_k: str | None = None,
        type_v: str | None = None,
        flash_attn: str | None = None,
    ) -> None:
        """`prefix_cache_cells`: cells kept between requests (None: ``n_ctx * slots``; 0: off), and written to
        `prefix_cache_dir` on close (``auto``: the user's cache; within `prefix_cache_dir_max_bytes`).
        `reencode`: every call re-encodes the whole context, as the paper's reference code (benchmarks only).
        `gpu_layers`: layers offloaded (None: all where llama.cpp can offload, else none; -1: all), on
        `main_gpu`, or spread over the GPUs by `split` ("layer", "row"; "none": main_gpu only) in
        `tensor_split` shares. `side_by_side`: "on", "off", or "auto"/None (on when every layer is on a GPU):
        whether its calls run in a thread of their own beside the other members'. `type_k`, `type_v`, `flash_attn`:
        the KV cache's types and flash attention (``KvCache``; None: llama.cpp's defaults)."""
        if slots < 1:
            raise ValueError("slots must be at least 1")
        if prefix_cache_cells is not None and prefix_cache_cells < 0:
            raise ValueError("prefix_cache_cells must be 0 (off) or more")
        self.path = Path(path)
        self.name = name or self.path.stem
        check_gguf(self.path)
        init_backend()
        self.reencode, self.slots, self.kv = reencode, slots, KvCache(type_k, type_v, flash_attn)
        with allocations() as allocated:
            self._load(gpu_layers, main_gpu, split, tensor_split, threads, side_by_side)
            self.vocab = Vocabulary(self._model, self.name, self.path, prompt)
            self.prompt = self.vocab.prompt
            cells, entries = prefix_layout(n_ctx, slots, prefix_cache_cells, reencode)
            self.context = self._open_context(n_ctx, n_batch, max_outputs, cells, entries)
        self.nbytes = sum(allocated) or self.nbytes  # as llama.cpp counts it (weights, caches, buffers), or weights
        self.n_ctx = (self.context.n_cells - cells) // slots  # one session's window
        self.context.window = self.n_ctx
        swa = int(lc.llama_model_n_swa(self._model))
        self.table = Slots(self.context, name=self.name, slots=slots, cells=cells, entries=entries, swa=swa)
        self.prefix_cache = self.table.prefix_cache
        if prefix_cache_dir is not None:
            self._open_disk(prefix_cache_dir, prefix_cache_dir_max_bytes)
        self.context.make_room = self.prefix_cache.evict_one  # no room: cached prefixes give way first
        self.softmax = LogSoftmax(self.vocab.n_vocab)
        self.context.reserve_outputs(self.n_ctx)
        self.private = PrivateContexts(self._open_private)

    def _open_disk(self, where: str | os.PathLike[str], max_bytes: int | None) -> None:
        """The prefix cache's directory, keyed by this member's settings; its files checked against what one
        token's state can take in this model."""
        settings = {**settings_of(self.n_ctx, self.gpu_layers, self.model_params), **layout(self.kv)}
        per_token = state_per_token(self._model)
        self.table.disk = open_disk(
            where, max_bytes, model=self.path, settings=settings, table=self.table, per_token=per_token
        )

    def _load(
        self,
        gpu_layers: int | None,
        main_gpu: int,
        split: str,
        tensor_split: tuple[float, ...] | None,
        threads: int | None,
        side_by_side: str | None,
    ) -> None:
        """The weights, where they run, the threads for what stays on the CPU, and whether to run side by side."""
        self._model, self.model_params = COMPUTE.run(
            partial(
                load_model,
                self.path,
                gpu_layers=gpu_layers_for(gpu_layers),
                main_gpu=main_gpu,
                split=split,
                tensor_split=tensor_split,
            )
        )
        total = lc.llama_model_n_layer(self._model) + 1  # llama.cpp counts the output layer as one more
        self.gpu_layers = offloaded_layers(self.model_params["n_gpu_layers"], total - 1)
        self.placement = placement(self.gpu_layers, total, main_gpu, split)
        self.threads = threads_for(threads, total - self.gpu_layers)
        self.capabilities = Capabilities(
            batched=True,
            prompt_fit=True,
            constrained=True,
            echo=True,
            speculates=True,
            parallel_safe=side_by_side_for(side_by_side, self.gpu_layers, total),
        )
        self.n_params = int(lc.llama_model_n_params(self._model))  # the gate's default leader is the largest
        self.nbytes = int(lc.llama_model_size(self._model))
        # Where its decodes run: side by side (wholly on a GPU), on the thread that calls it; else on the one
        # thread every member on the CPU computes on (backends/compute.py says why).
        self.compute = compute_here if self.capabilities.parallel_safe else COMPUTE.run

    def _open_context(self, n_ctx: int, n_batch: int, max_outputs: int, cells: int, entries: int) -> Context:
        """A context of `slots` windows of `n_ctx` tokens, 8 sequences per slot, and `cells` cells in
        `entries` sequences for the prefix cache, in one unified cache."""
        try:
            return Context(
                self._model,
                name=self.name,
                n_ctx=n_ctx * self.slots + cells,
                n_batch=n_batch,
                n_seq=SEQS_PER_SESSION * self.slots + entries,
                threads=self.threads,
                n_vocab=self.vocab.n_vocab,
                max_outputs=max_outputs,
                window=n_ctx,
                shape=f"{self.slots} x {n_ctx} tokens for {self.path}",
                compute=self.compute,
                kv=self.kv,
            )
        except MemberLoadError:
            lc.llama_model_free(self._model)
            raise

    def _open_private(self) -> Context:
        """A context for one deterministic session: its sequences, the shared context's batch size, and one
        window plus a batch of cells (a round's candidates, at most a batch, sit beside the context)."""
        shared = self.context
        ctx = Context(
            self._model,
            name=self.name,
            n_ctx=self.n_ctx + shared.n_batch,
            n_batch=shared.n_batch,
            n_seq=SEQS_PER_SESSION,
            threads=self.threads,
            n_vocab=self.vocab.n_vocab,
            max_outputs=shared.max_outputs,
            window=self.n_ctx,
            shape=f"{self.n_ctx} tokens for {self.path} (a deterministic session's own)",
            compute=self.compute,
            kv=self.kv,
        )
        ctx.reserve_outputs(self.n_ctx)
        return ctx

    # --- the protocol, from the parts ----------------------------------------------------
    def echo(self, prompt: str | Sequence[int], top_k: int = 0) -> list[PromptToken]:
        ids = self.vocab.tokenize_plain(prompt) if isinstance(prompt, str) else list(prompt)
        return echo_tokens(ids, top_k, vocab=self.vocab, ctx=self.context, table=self.table, softmax=self.softmax)

    def open_session(
        self, prompt: list[int], seed: int | None, cache_salt: str | None = None, deterministic: bool = False
    ) -> LlamaCppSession:
        slot = self.table.take()  # a deterministic session's too: the slots bound the sessions open at once
        own = None
        try:
            own = self.private.take() if deterministic else None
            session = LlamaCppSession(
                prompt,
                seed,
                vocab=self.vocab,
                softmax=self.softmax,
                ctx=own if own is not None else self.context,
                table=self.table,
                slot=slot,
                private=None if own is None else self.private,
                reencode=self.reencode,
            )
            session.cache_salt = cache_salt
            if own is None:
                session.n_cached = session.stats.reused = self.table.reuse_prefix(prompt, session.base, cache_salt)
        except BaseException:
            if own is not None:
                self.private.give_back(own)
            self.table.release(slot)  # the session never opened: its slot is free again, with nothing to keep
            raise
        return session

    def occupancy(self) -> Occupancy:
        seen = self.table.occupancy()
        if seen.cache_cells is None or seen.stray_cells is None:
            return seen
        held, stray = self.private.cells()  # deterministic sessions' own contexts
        return replace(seen, cache_cells=seen.cache_cells + held, stray_cells=seen.stray_cells + stray)

    # These take only the member's own sessions (narrower than Member's: the engine never mixes members).
    def draft_many(
        self,
        sessions: Sequence[LlamaCppSession],  # type: ignore[override]  # (see above)
        requests: Sequence[tuple[Any, ...]],
    ) -> list[DraftTokens | Exception]:
        """``draft`` for several sessions, one ``llama_decode`` per token step for all of them."""
        return batch.draft_many(sessions, requests)

    def score_many(
        self,
        sessions: Sequence[LlamaCppSession],  # type: ignore[override]  # (see above)
        texts: Sequence[tuple[Sequence[str]]],
    ) -> list[list[TokenScores] | Exception]:
        """``score`` for several sessions: every session's new candidates in one batch (chunked at n_batch)."""
        return batch.score_many(sessions, texts)

    def save_prefix_cache(self) -> int:
        """Write the cached prefixes not on disk yet to ``prefix_cache_dir`` (none without one); how many
        files. Call it between decodes, from the thread that runs this member's calls."""
        disk = self.table.disk
        return disk.save() if disk is not None and self.context.is_open else 0

    def close(self) -> None:
        if getattr(self, "context", None) is not None and self.context.is_open:
            try:
                self.save_prefix_cache()
            except Exception:  # the cache is a favour to the next run: closing goes on
                log.exception("%s: could not write its prefix cache", self.name)
            self.private.close()
            self.context.close()
            lc.llama_model_free(self._model)

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


def prefix_layout(n_ctx: int, slots: int, prefix_cache_cells: int | None, reencode: bool) -> tuple[int, int]:
    """The prefix cache's cells (None: ``n_ctx * slots``) and its entries' sequences (none: no cells)."""
    cells = n_ctx * slots if prefix_cache_cells is None else prefix_cache_cells
    entries = prefix_entries(slots, cells, reencode)
    return (cells if entries > 0 else 0), entries


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
