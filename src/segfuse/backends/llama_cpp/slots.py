"""Which session holds which part of a llama.cpp member's cache, and the prefixes kept between requests
(the layout is in ``member.py``'s docstring).

Slot k owns sequences 8k..8k+7 of the unified cache; each prefix-cache entry is one
sequence after the slots'. Nothing here decodes: it copies and drops cells through the
member's :class:`~segfuse.backends.llama_cpp.context.Context`. With a directory for the
prefix cache (``persist.py``), a session whose prompt finds a longer prefix on disk than
in memory reads it back first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from ...errors import NoFreeSlotError
from ..base import Occupancy
from ..prefix_cache import PrefixCache
from .context import Context

MAX_CANDIDATES = 7  # sequences 1..7 of a session hold one distinct candidate each per round
SEQS_PER_SESSION = MAX_CANDIDATES + 1
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
# How long opening a session waits for a slot another thread's session holds. Sessions are closed by
# whoever opened them, so in one thread (the server's worker) a wait cannot end: fail clearly instead.
SLOT_WAIT_S = 30.0


def prefix_entries(slots: int, cells: int, reencode: bool) -> int:
    """Sequences for prefix-cache entries after `slots` sessions' (none without cells, or when re-encoding)."""
    return min(max(4, 2 * slots), MAX_SEQUENCES - SEQS_PER_SESSION * slots) if cells and not reencode else 0


class PrefixDisk(Protocol):
    """Where the prefix cache is kept across runs (``persist.DiskPrefixes``)."""

    def read_back(self, prompt: list[int], limit: int, salt: str | None) -> bool:
        """Make a longer prefix of `prompt` than memory holds an entry, if one is on disk."""
        ...

    def save(self) -> int:
        """Write the entries not on disk yet; how many files."""
        ...


class Slots:
    """`slots` session windows of a context and the prefix cache in `entries` sequences after them.

    `swa`: the model's sliding window (0: none). Its window layers must hold the `swa` positions
    before the first token a session decodes; an entry read back from disk holds only the last
    ones, so it serves only matches that reach them (:meth:`min_match`)."""

    def __init__(self, ctx: Context, *, name: str, slots: int, cells: int, entries: int, swa: int = 0) -> None:
        self.ctx, self.name, self.slots, self.swa = ctx, name, slots, swa
        first = SEQS_PER_SESSION * slots
        self.entry_seqs = range(first, first + entries)
        self.prefix_cache: PrefixCache[int] = PrefixCache(
            cells, self.entry_seqs, lambda seq: ctx.seq_rm(seq, -1, -1), self.min_match
        )
        self.disk: PrefixDisk | None = None  # the prefix cache's directory (prefix_cache_dir), if any
        self._free = list(range(slots))
        self._slot_free = threading.Condition()
        self.wait_s = SLOT_WAIT_S

    @staticmethod
    def base(slot: int) -> int:
        """The first sequence of `slot` (its session's context; its candidates follow)."""
        return slot * SEQS_PER_SESSION

    @property
    def free(self) -> int:
        with self._slot_free:
            return len(self._free)

    def take(self) -> int:
        """A free slot, cleared; with every slot taken, wait up to ``wait_s`` for a session to close."""
        with self._slot_free:
            if not self._slot_free.wait_for(lambda: bool(self._free), self.wait_s):
                raise NoFreeSlotError(
                    f"no free slot on member {self.name} within {self.wait_s:g} s "
                    f"(all {self.slots} are held by open sessions)",
                    "retry later, or load the member with more slots (max_concurrent)",
                )
            if len(self._free) == self.slots and not self.prefix_cache.handles:
                # No other session and nothing cached: start from an empty cache, so the cells are used
                # from the first one on and attention spans only them (a lone request runs as with a
                # single slot).
                self.ctx.clear()
            slot = self._free.pop(0)
            self.clear(slot)
            return slot

    def clear(self, slot: int) -> None:
        """Drop every cell of `slot`'s sequences."""
        for seq in range(self.base(slot), self.base(slot + 1)):
            self.ctx.seq_drop(seq)

    def release(self, slot: int, keep: list[int] | None = None, salt: str | None = None) -> None:
        """Free `slot`: `keep`, the tokens its first sequence holds from position 0, kept in the prefix cache
        (under `salt`), its cells dropped, and the slot back among the free ones whatever fails on the way
        (keeping the prefix is a favour to later requests)."""
        try:
            if keep:
                self.keep_prefix(self.base(slot), keep, salt)
        finally:
            try:
                self.clear(slot)
            finally:
                self._free_again(slot)

    def _free_again(self, slot: int) -> None:
        with self._slot_free:
            if slot not in self._free:
                self._free.append(slot)
                self._free.sort()
            self._slot_free.notify()

    def reuse_prefix(self, prompt: list[int], seq: int, salt: str | None = None) -> int:
        """Copy the longest prefix of `prompt` cached under `salt` into sequence `seq`; how many tokens
        it covers.

        At least the prompt's last token is left to decode: its logits row starts the answer.
        """
        cache = self.prefix_cache
        with cache.lock:
            if self.disk is not None:
                self.disk.read_back(prompt, len(prompt) - 1, salt)
            found = cache.lookup(prompt, len(prompt) - 1, salt)
            if found is None:
                return 0
            entry, length = found
            self.ctx.seq_cp(entry, seq, 0, length)
            return length

    def min_match(self, seq: int) -> int:
        """The shortest match sequence `seq` may serve: any, unless its window layers start late."""
        first = self.ctx.seq_pos_min(seq) if self.swa else 0
        return first + self.swa - 1 if first > 0 else 0

    @contextmanager
    def spare(self) -> Iterator[int | None]:
        """A free slot's first sequence to work in, held meanwhile and emptied after; None when none is free."""
        with self._slot_free:
            slot = self._free.pop(0) if self._free else None
        if slot is None:
            yield None
            return
        try:
            yield self.base(slot)
        finally:
            self.release(slot)

    def keep_prefix(self, seq: int, tokens: list[int], salt: str | None = None) -> None:
        """Keep the cells of `tokens`, held by sequence `seq` from position 0, in the prefix cache
        (under `salt`)."""

        def copy(entry: int, n: int) -> None:
            self.ctx.seq_rm(entry, -1, -1)
            self.ctx.seq_cp(seq, entry, 0, n)

        self.prefix_cache.store(tokens, copy, salt)

    def occupancy(self) -> Occupancy:
        """Slots free; the cache positions open sessions hold (0 when none is open); the prefix cache;
        and stray positions: held by a free slot, by no live entry, or by an entry beyond its tokens.

        A cell shared by several sequences (a candidate copied from the context, a prefix kept
        between requests) counts once per sequence. Read it between decodes, from the thread that
        decodes.
        """
        if not self.ctx.is_open:
            return Occupancy(self.slots, self.free, None)
        with self._slot_free:
            free = set(self._free)
        entries = self.prefix_cache.lengths()
        held = stray = 0
        for seq in range(SEQS_PER_SESSION * self.slots):
            cells = self.ctx.seq_cells(seq)
            held, stray = (held, stray + cells) if seq // SEQS_PER_SESSION in free else (held + cells, stray)
        for seq in self.entry_seqs:
            cells, kept = self.ctx.seq_cells(seq), entries.get(seq, 0)
            if kept and self.swa:  # read back from disk, its window layers hold only the window's last positions
                cells += max(0, self.ctx.seq_pos_min(seq))
            stray += abs(cells - kept)
        return Occupancy(self.slots, len(free), held, stray, self.prefix_cache.stats())
