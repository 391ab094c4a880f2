"""Which token prefixes a member keeps cached between requests, and which to evict.

A chat's next turn, or another user's request with the same system prompt,
starts with tokens some earlier session already decoded. When a session ends,
its tokens (templated prompt plus the answer as the member accepted it) stay
cached as an *entry*; a new session starts from the entry with the longest
common prefix and decodes only the rest. Entries are evicted least recently
used first when their cells would pass the bound.

A *salt* (a request's ``cache_salt``, as in vLLM) keeps clients apart: an
entry stored under one salt is found only by sessions with the same salt (no
salt is a salt of its own), so a client cannot learn from reuse counts or
timing whether another client's prompt starts like its own.

This module is the bookkeeping alone, backend-agnostic: an entry names a
*handle* (for llama.cpp a cache sequence id) and the backend copies cells in
and out through the callables it passes. The bound counts each entry's tokens
in full even where entries share cells, so the cells held never pass it.
Where a backend's entry cannot serve every match (a sliding-window model's
state read back from disk keeps only the window's last cells), `min_match`
says the shortest match it may serve. An entry remembers where the shorter
entries it replaced ended (`marks`: where a request's prompt ended), so that
a backend writing entries to disk (``prefix_files.py``) can also keep them
at those lengths.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import numpy as np

H = TypeVar("H")  # what the backend names an entry's storage by (a sequence id, a cache object)
MARKS = 4  # lengths of replaced entries an entry remembers (the longest)


@dataclass(eq=False)  # entries are told apart by identity (their tokens are arrays)
class Entry(Generic[H]):
    tokens: np.ndarray  # the cached token ids
    handle: H
    used: int  # logical clock of the last hit or store (least recently used goes first)
    salt: str | None = None  # only sessions with the same salt may start from it
    marks: tuple[int, ...] = ()  # lengths of the entries it replaced (where their prompts ended)


@dataclass(frozen=True)
class PrefixStats:
    """What the cache holds now and has done so far."""

    bound: int  # cells it may hold (0: off)
    entries: int
    cells: int  # tokens held, summed over entries
    hits: int  # sessions that started from a cached prefix
    misses: int  # sessions that found none
    reused_tokens: int  # prompt tokens not decoded thanks to a hit
    evictions: int  # entries dropped to make room
    restored: int = 0  # entries read back from disk (prefix_cache_dir)
    saved: int = 0  # entries written to disk


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache(Generic[H]):
    """Entries of cached token prefixes within `bound` cells, over a fixed set of handles.

    `drop(handle)` frees an entry's storage; `min_match(handle)`, the shortest match
    the entry may serve (default 0: any). All methods are safe to call from
    several threads; the backend's copies run under the same lock.
    """

    def __init__(
        self,
        bound: int,
        handles: Sequence[H],
        drop: Callable[[H], None],
        min_match: Callable[[H], int] | None = None,
    ) -> None:
        self.bound = max(0, bound)
        self._free = list(handles)
        self._drop = drop
        self._min_match = min_match or _any_match
        self._entries: list[Entry[H]] = []
        self._clock = 0
        self._hits = self._misses = self._reused = self._evictions = 0
        self.restored = self.saved = 0  # counted by the backend that reads and writes entries on disk
        self.lock = threading.RLock()

    @property
    def enabled(self) -> bool:
        return self.bound > 0 and bool(self._free or self._entries)

    @property
    def handles(self) -> list[H]:
        """Handles of live entries."""
        with self.lock:
            return [e.handle for e in self._entries]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, prompt: Sequence[int], limit: int, salt: str | None = None) -> tuple[H, int] | None:
        """The entry under `salt` sharing the longest prefix with `prompt` (at most `limit` tokens):
        (handle, length).

        Counts a hit (and the tokens it saves) or a miss. The caller copies the
        prefix from the handle while it holds :attr:`lock`.
        """
        if not self.enabled:
            return None
        with self.lock:
            best, length = self._best(prompt, limit, salt)
            if best is None:
                self._misses += 1
                return None
            best.used = self._tick()
            self._hits += 1
            self._reused += length
            return best.handle, length

    def peek(self, prompt: Sequence[int], limit: int, salt: str | None = None) -> int:
        """How many tokens :meth:`lookup` would find now (counting nothing)."""
        if not self.enabled:
            return 0
        with self.lock:
            return self._best(prompt, limit, salt)[1]

    def _best(self, prompt: Sequence[int], limit: int, salt: str | None) -> tuple[Entry[H] | None, int]:
        wanted = np.asarray(prompt, dtype=np.int64)
        best, length = None, 0
        for entry in self._entries:
            if entry.salt != salt:
                continue
            n = min(common_prefix(entry.tokens, wanted), limit)
            if n > length and n >= self._min_match(entry.handle):
                best, length = entry, n
        return best, length

    def store(self, tokens: Sequence[int], copy: Callable[[H, int], None], salt: str | None = None) -> None:
        """Keep `tokens` (cut to the bound) as an entry under `salt`; `copy(handle, n)` puts their cells
        under `handle`.

        An entry (under the same salt) that already covers them, and may serve
        any match, is only marked used; entries they cover are replaced (their
        lengths become the new entry's marks); the least recently used go until
        the new one fits.
        """
        if not self.enabled:
            return
        kept = np.asarray(tokens[: self.bound], dtype=np.int64)
        if not len(kept):
            return
        with self.lock:
            mine = [e for e in self._entries if e.salt == salt]
            for entry in mine:
                covers = len(entry.tokens) >= len(kept) and common_prefix(entry.tokens, kept) == len(kept)
                if covers and self._min_match(entry.handle) == 0:
                    entry.used = self._tick()
                    return
            marks: set[int] = set()
            for entry in [e for e in mine if common_prefix(e.tokens, kept) == len(e.tokens)]:
                marks.update((len(entry.tokens), *entry.marks))
                self._remove(entry)
            while self._entries and (self.cells + len(kept) > self.bound or not self._free):
                self.evict_one()
            if not self._free:
                return
            handle = self._free.pop(0)
            try:
                copy(handle, len(kept))
            except BaseException:
                self._free.append(handle)  # nothing was kept: the handle is free again, emptied
                with contextlib.suppress(Exception):
                    self._drop(handle)
                raise
            self._entries.append(Entry(kept, handle, self._tick(), salt, tuple(sorted(marks - {len(kept)})[-MARKS:])))

    def evict_one(self) -> bool:
        """Drop the least recently used entry (a request needs the room); False when there is none."""
        with self.lock:
            if not self._entries:
                return False
            self._remove(min(self._entries, key=lambda e: e.used))
            self._evictions += 1
            return True

    def clear(self) -> None:
        with self.lock:
            while self._entries:
                self._remove(self._entries[0])

    def _remove(self, entry: Entry[H]) -> None:
        self._entries.remove(entry)
        self._drop(entry.handle)
        self._free.append(entry.handle)

    @property
    def cells(self) -> int:
        return sum(len(e.tokens) for e in self._entries)

    def snapshot(self) -> list[Entry[H]]:
        """The live entries, most recently used first (copies: their handles may be reused once the lock
        is let go, so read their storage under :attr:`lock`)."""
        with self.lock:
            return [replace(e) for e in sorted(self._entries, key=lambda e: -e.used)]

    def lengths(self) -> dict[H, int]:
        """Tokens held per live handle (to check the backend's storage against)."""
        with self.lock:
            return {e.handle: len(e.tokens) for e in self._entries}

    def stats(self) -> PrefixStats:
        with self.lock:
            return PrefixStats(
                self.bound,
                len(self._entries),
                self.cells,
                self._hits,
                self._misses,
                self._reused,
                self._evictions,
                self.restored,
                self.saved,
            )


def _any_match(handle: object) -> int:
    return 0
