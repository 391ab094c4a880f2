"""``deterministic`` with plain fusion: every member drafts and votes every round (gate None, accept_margin
None), and the same greedy request gives byte-identical answers and rounds whatever runs beside it or
before it (docs/server.md, The same request, the same text).

Three ensembles: the three embedded llama.cpp members; a transformers member (SmolLM2, one torch thread)
beside two llama.cpp members; and a Ray member (SmolLM2 on a copy in a real two-node Ray cluster on
loopback, tests/ray_cluster.py) beside two local llama.cpp members. Each answers the target alone on
fresh members first; then again among other generations drafting and voting beside it, some of them
sharing its prompt (cache hits of the prefix the plain requests left), several at once.
"""

from __future__ import annotations

from typing import Any

import pytest

from segfuse import Ensemble
from segfuse.engine.scheduler import run_all
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.types import Result

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

TARGET = "Explain in one sentence what a binary search does."
OTHERS = ["Write a haiku about autumn leaves.", "List three fruits that are red."]
CONTINUED = [
    {"role": "user", "content": TARGET},
    {"role": "assistant", "content": "It halves the range each step."},
    {"role": "user", "content": "Say it in fewer words."},
]  # shares the target's prompt
SMALL = {"threads": 1, "n_ctx": 1024, "slots": 4}  # one thread: equal numbers, and room on a busy machine
VOTE = {"temperature": 0.0, "max_tokens": 16, "gate": None, "accept_margin": None}  # every member, every round
DETERMINISTIC, PLAIN = FusionOptions.build(**VOTE, deterministic=True), FusionOptions.build(**VOTE)
LOCAL = ["qwen2.5-coder-0.5b", "gemma3-270m"]


def decided(result: Result) -> list[tuple[Any, ...]]:
    """What every round decided, to the bit (its timings aside): who drafted what, every verifier's raw and
    normalised scores, the weights, the aggregate and the winner."""
    return [
        (
            r.active,
            [(c.model, c.text) for c in r.candidates],
            r.raw_scores,
            r.scores,
            r.weights,
            r.aggregate,
            r.winner_index,
            r.decision,
        )
        for r in result.rounds
    ]


def among_others(ensemble: Ensemble, max_concurrent: int) -> list[Result]:
    """The target twice, deterministic, among plain generations (one sharing its whole prompt, one
    continuing its chat, unrelated ones), `max_concurrent` at once; every outcome an answer."""
    requests = [
        FusionRequest.of(TARGET, DETERMINISTIC),
        FusionRequest.of(OTHERS[0], PLAIN),
        FusionRequest.of(TARGET, PLAIN),
        FusionRequest.of(CONTINUED, PLAIN),
        FusionRequest.of(TARGET, DETERMINISTIC),
        FusionRequest.of(OTHERS[1], PLAIN),
    ]
    outcomes = run_all([ensemble.steps(r) for r in requests], max_concurrent=max_concurrent)
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    return [o for o in outcomes if isinstance(o, Result)]


def assert_the_same_answer_alone_and_among_others(ensemble: Ensemble) -> None:
    alone = ensemble.generate(FusionRequest.of(TARGET, DETERMINISTIC))  # the first request on fresh members
    assert alone.text.strip() and len(alone.rounds) >= 2 and set(alone.counters) == set(ensemble.names)
    assert all(len(r.candidates) == len(ensemble.members) for r in alone.rounds)  # every member drafted
    ensemble.generate(FusionRequest.of(TARGET, PLAIN))  # now the target's prompt and answer are cached
    mixed = among_others(ensemble, max_concurrent=4)
    for again in (mixed[0], mixed[4]):
        assert again.text == alone.text
        assert [(s.model, s.text) for s in again.segments] == [(s.model, s.text) for s in alone.segments]
        assert decided(again) == decided(alone)
        assert all(c["reused"] == 0 for c in again.counters.values())  # it read its whole prompt itself
    # The plain copy of the target read a cached prefix, in other batches: numbers a deterministic session
    # would not be given (whether they moved its scores, or its text, here is printed, not asserted).
    plain = mixed[2]
    assert any(c["reused"] > 0 for c in plain.counters.values()), plain.counters
    print(
        f"{[type(m).__name__ for m in ensemble.members]}: the plain copy among others: the same text "
        f"{plain.text == alone.text}, the same rounds to the bit {decided(plain) == decided(alone)}"
    )


def test_three_llama_cpp_members_vote_the_same_answer_among_other_traffic():
    with Ensemble(**SMALL) as ensemble:
        assert_the_same_answer_alone_and_among_others(ensemble)
        for member in ensemble.members:  # the plain requests shared the cache: they were hits
            assert member.occupancy().prefix.hits > 0, member.name
            held = member.occupancy()
            assert (held.free_slots, held.cache_cells, held.stray_cells) == (held.slots, 0, 0), (member.name, held)


def test_a_transformers_member_beside_llama_cpp_members_votes_the_same_answer_among_others():
    """The transformers member's deterministic session reads its whole prompt and drafts and scores alone,
    never in a forward pass shared with the other sessions drafting beside it."""
    pytest.importorskip("transformers", reason="the hf extra is not installed: pip install '.[hf]'")
    with Ensemble(["transformers:smollm2-135m", *LOCAL], **SMALL) as ensemble:
        assert_the_same_answer_alone_and_among_others(ensemble)


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray", reason="the ray extra is not installed: pip install '.[ray]'")
    from ray_cluster import LoopbackCluster

    running = LoopbackCluster().start()
    yield running
    left = running.stop()
    assert not left, [(p.pid, p.name()) for p in left]


def test_a_ray_member_beside_local_members_votes_the_same_answer_among_others(cluster):
    """The Ray member's copy opens the deterministic session in a context of its own, as a local member
    does, and batches it with no other session's decode (the copy gathers the callers' calls)."""
    with Ensemble(["ray:smollm2-135m#cpus=0.25", *LOCAL], **SMALL) as ensemble:
        assert_the_same_answer_alone_and_among_others(ensemble)
        ray_member = ensemble.members[0]
        ray_member.refresh()
        [copy] = ray_member.view()
        assert copy["stats"]["draft_batches"] < copy["stats"]["draft_calls"], copy  # sessions were batched
