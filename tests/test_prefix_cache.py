"""The prefix cache's bookkeeping (pure logic): longest prefix, covering entries, the bound, LRU.

The real llama.cpp cache behind it is tested in test_prefix_cache_real_models.py.
"""

from __future__ import annotations

import numpy as np

from segfuse.backends.prefix_cache import PrefixCache, common_prefix


def make(bound, handles=4):
    stored: dict[int, int] = {}
    dropped: list[int] = []

    def copy(handle, n):
        stored[handle] = n

    cache = PrefixCache(bound, range(handles), dropped.append)
    return cache, copy, stored, dropped


def test_common_prefix():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([], dtype=int), np.array([1])) == 0
    assert common_prefix(np.array([5]), np.array([1])) == 0


def test_lookup_finds_the_longest_shared_prefix_within_the_limit():
    cache, copy, _stored, _ = make(100)
    cache.store([1, 2, 3, 4], copy)
    cache.store([1, 2, 9, 9, 9], copy)
    assert cache.lookup([1, 2, 3, 4, 5, 6], limit=5) == (0, 4)
    assert cache.lookup([1, 2, 9, 9, 9], limit=4) == (1, 4)  # the last prompt token is always decoded
    assert cache.lookup([7, 7], limit=1) is None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.reused_tokens) == (2, 1, 8)


def test_an_entry_that_extends_another_replaces_it_and_a_covered_one_is_not_stored():
    cache, copy, _stored, dropped = make(100)
    cache.store([1, 2, 3], copy)  # a prompt, kept while its request runs
    cache.store([1, 2, 3, 4, 5], copy)  # the same request at its end
    assert cache.lengths() == {1: 5} and dropped == [0]
    cache.store([1, 2], copy)  # already covered
    assert cache.lengths() == {1: 5}
    assert cache.stats().evictions == 0  # replacing is not evicting


def test_least_recently_used_entries_go_first_and_the_bound_holds():
    cache, copy, _stored, dropped = make(10)
    cache.store([1] * 4, copy)
    cache.store([2] * 4, copy)
    cache.lookup([1] * 5, limit=4)  # entry 0 is now the most recently used
    cache.store([3] * 4, copy)
    assert sorted(cache.lengths().values()) == [4, 4] and dropped == [1]
    assert cache.stats().cells <= cache.bound
    cache.store(list(range(50)), copy)  # longer than the bound: its first 10 tokens are kept
    assert list(cache.lengths().values()) == [10]


def test_running_out_of_handles_evicts_and_an_evicted_entry_is_missed():
    cache, copy, _stored, _dropped = make(1000, handles=2)
    for k in range(3):
        cache.store([k, k, k], copy)
    assert len(cache.lengths()) == 2 and cache.lookup([0, 0, 0, 1], limit=3) is None
    assert cache.evict_one() and cache.evict_one() and not cache.evict_one()
    assert cache.stats().evictions == 3


def test_a_bound_of_zero_is_off():
    cache, copy, stored, _ = make(0)
    cache.store([1, 2, 3], copy)
    assert stored == {} and cache.lookup([1, 2, 3, 4], limit=3) is None
    assert cache.stats().misses == 0


def test_peek_counts_nothing_and_an_entry_serves_only_matches_from_its_min_match():
    floors: dict[int, int] = {}
    dropped: list[int] = []
    cache = PrefixCache(100, range(4), dropped.append, min_match=lambda h: floors.get(h, 0))
    cache.store(list(range(10)), lambda h, n: None)
    floors[0] = 9  # e.g. read back from disk: its sliding-window layers hold only the last positions
    assert cache.peek([*range(5), 99], limit=5) == 0  # a match of 5 is too short for it
    assert cache.peek([*range(10), 99], limit=10) == 10
    assert cache.stats().hits == cache.stats().misses == 0
    assert cache.lookup([*range(5), 99], limit=5) is None
    cache.store(list(range(6)), lambda h, n: None)  # it does not cover a prefix it cannot serve
    assert sorted(cache.lengths().values()) == [6, 10]
    assert cache.lookup([*range(6), 99], limit=6) == (1, 6)


def test_an_entry_remembers_where_the_entries_it_replaced_ended():
    cache, copy, _stored, _ = make(100)
    cache.store([1, 2, 3], copy)  # a request's prompt, kept once read
    cache.store([1, 2, 3, 4, 5], copy)  # its prompt and answer
    cache.store([1, 2, 3, 4, 5, 6, 7, 8], copy)  # the next turn
    (entry,) = cache.snapshot()
    assert entry.marks == (3, 5) and len(entry.tokens) == 8
    cache.store([9, 9], copy)
    assert [len(e.tokens) for e in cache.snapshot()] == [2, 8]  # most recently used first
