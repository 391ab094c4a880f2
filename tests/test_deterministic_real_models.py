"""``deterministic`` in the library: a greedy request's answer does not depend on the prefix cache or on
the generations decoded beside it (docs/server.md, The same request, the same text)."""

from __future__ import annotations

import pytest

from segfuse import Ensemble
from segfuse.engine.scheduler import run_all
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest

pytestmark = pytest.mark.models

LEADER = "qwen2.5-coder-0.5b"
TARGET = "Explain in one sentence what a binary search does."
OTHERS = ["Write a haiku about autumn leaves.", "List three fruits that are red."]


def test_deterministic_answers_are_a_lone_fresh_answer_among_cached_and_batched_work():
    greedy = {"temperature": 0.0, "max_tokens": 24}
    plain, deterministic = FusionOptions.build(**greedy), FusionOptions.build(**greedy, deterministic=True)
    with Ensemble([LEADER], slots=3, threads=1, n_ctx=1024) as ensemble:
        member = ensemble.members[0]
        first = ensemble.generate(TARGET, options=deterministic)  # the first request on a fresh member
        ensemble.generate(TARGET, options=plain)  # now the target's prompt and answer are cached
        mixed = run_all(
            [
                ensemble.steps(FusionRequest.of(TARGET, deterministic)),
                ensemble.steps(FusionRequest.of(OTHERS[0], plain)),
                ensemble.steps(FusionRequest.of(TARGET, plain)),
                ensemble.steps(FusionRequest.of(OTHERS[1], plain)),
                ensemble.steps(FusionRequest.of(TARGET, deterministic)),
            ],
            max_concurrent=3,
        )
        assert not [r for r in mixed if isinstance(r, BaseException)], mixed
        assert first.text.strip() and mixed[0].text == mixed[4].text == first.text
        assert first.counters[LEADER]["reused"] == mixed[0].counters[LEADER]["reused"] == 0
        assert mixed[2].counters[LEADER]["reused"] > 0  # the cache was there to be hit by plain requests
        # Deterministic sessions at once each had a context of their own, emptied when it ended.
        assert 1 <= len(member.private) <= member.slots
        seen = member.occupancy()
        assert (seen.free_slots, seen.cache_cells, seen.stray_cells) == (3, 0, 0), seen
