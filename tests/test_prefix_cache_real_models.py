"""The prefix cache on the real embedded members: the same answers, less prefill, a consistent cache.

The cache only saves decoding tokens whose cells another session already computed, but those cells were
computed in other batches, at other cache indices, so llama.cpp sums them in another order
(docs/server.md): greedy answers with and without it may part where two tokens were all but tied, as
batching several requests already makes them. So answers with and without the cache are compared on the
same prompts token by token: the same tokens up to a parting (if any) where both answers' two tokens
were within ``NEAR_TIE_NATS`` (tests/helpers.py) of each other; members' scores of fixed texts agree to
kernel noise (``assert_scores_agree``). A wrong cell would part answers at clear choices and move the
likely tokens' probabilities far more.
"""

from __future__ import annotations

import pytest

from helpers import TOP_LOGPROBS, assert_scores_agree, same_until_a_near_tie
from segfuse import Ensemble
from segfuse.errors import PromptTooLongError
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.types import Message, Result

pytestmark = pytest.mark.models

SYSTEM = (
    "You are a patient tutor. Answer in one or two short sentences. The school's library opens at 8 and "
    "closes at 17 on weekdays; on Saturdays it opens at 10 and closes at 14; it is closed on Sundays. "
    "Students may borrow five books at a time, for three weeks, and renew them twice."
)
TURNS = ["When does the library open on Saturdays?", "And how many books may I borrow?", "Can I renew them?"]
GREEDY = {"temperature": 0.0, "max_tokens": 24}
VOTE = {**GREEDY, "gate": None, "accept_margin": None}  # every round a full vote: every member decodes


def chat(ensemble: Ensemble, options: dict, replay: list[Result] | None = None) -> list[Result]:
    """Three turns, each answer sent back as the assistant's message, as a chat UI does (`replay`: those
    answers' texts are sent back instead, so that each turn's prompt is the replayed chat's)."""
    messages = [Message("system", SYSTEM)]
    results = []
    for turn, question in enumerate(TURNS):
        messages.append(Message("user", question))
        results.append(ensemble.generate(messages, **options))
        messages.append(Message("assistant", (replay or results)[turn].text))
    return results


@pytest.fixture(scope="module")
def pair():
    with Ensemble(prefix_cache_cells=0) as off, Ensemble() as on:
        yield off, on


def idle_and_consistent(ensemble: Ensemble) -> None:
    for member in ensemble.members:
        held = member.occupancy()
        assert held.free_slots == held.slots and held.cache_cells == 0, member.name
        assert held.stray_cells == 0, member.name
        assert held.prefix is not None and held.prefix.cells <= held.prefix.bound, member.name


def test_a_chat_answers_the_same_and_later_turns_reuse_the_earlier_ones(pair):
    off, on = pair
    warm = chat(on, {**GREEDY, "top_logprobs": TOP_LOGPROBS})
    cold = chat(off, {**GREEDY, "top_logprobs": TOP_LOGPROBS}, replay=warm)  # the same prompts, no cache
    shared = [same_until_a_near_tie(w, c) for w, c in zip(warm, cold)]
    print(f"tokens shared with the uncached answer, turn by turn: {shared} of {[len(w.logprobs()) for w in warm]}")
    assert all(c["reused"] == 0 for r in cold for c in r.counters.values())
    assert_later_turns_reuse(warm, cold)
    idle_and_consistent(on)


def assert_later_turns_reuse(warm: list[Result], cold: list[Result]) -> None:
    """From turn 2 on, every member that read the prompt read only the new question (and its template)."""
    for turn in (1, 2):
        for name, counts in warm[turn].counters.items():
            full = counts["prompt"] + counts["reused"]
            assert full == cold[turn].counters[name]["prompt"] + cold[turn].counters[name]["reused"], name
            assert counts["reused"] > full - 60 and counts["prompt"] < full / 3, (name, counts, full)


def test_in_a_vote_every_member_reuses_its_cache_and_scores_as_without_it(pair):
    off, on = pair
    warm = chat(on, VOTE)
    assert set(warm[1].counters) == set(on.names)  # every member read the prompt and followed the answer
    assert_later_turns_reuse(warm, warm)
    messages = [
        Message("system", SYSTEM),
        Message("user", TURNS[0]),
        Message("assistant", warm[0].text),
        Message("user", TURNS[1]),
    ]
    assert_cached_scores_agree(on, off, messages, [" You may borrow five books.", " Five."])
    idle_and_consistent(on)


def assert_cached_scores_agree(on: Ensemble, off: Ensemble, messages: list[Message], texts: list[str]) -> None:
    """Teacher-forced: each member's session from the cache and from scratch scores `texts` the same, to
    kernel noise (tests/helpers.py); a wrong cell would be far off."""
    for cached_member, member in zip(on.members, off.members):
        cached, fresh = cached_member.start(messages, seed=0, reserve=64), member.start(messages, seed=0, reserve=64)
        try:
            apart = [
                assert_scores_agree(a.logprobs, b.logprobs, member.name)
                for a, b in zip(cached.score(texts), fresh.score(texts))
            ]
            print(
                f"{member.name}: scores with and without the cache at most {max(p for p, _ in apart):.4f} in "
                f"probability, {max(n for _, n in apart):.4f} nats apart"
            )
            assert cached.counters()["reused"] > 0 and fresh.counters()["reused"] == 0
        finally:
            cached.close()
            fresh.close()


def test_concurrent_users_sharing_a_system_prompt_answer_the_same(pair):
    off, on = pair
    users = [
        [Message("system", SYSTEM), Message("user", q)]
        for q in ("Is the library open on Sunday?", "How long is a loan?", "When does it close on weekdays?")
    ]
    on.generate(users[0], **GREEDY)  # the system prompt is now cached
    requests = [FusionRequest.of(u, FusionOptions.build(**GREEDY), top_logprobs=TOP_LOGPROBS) for u in users]
    for cached, uncached in zip(on.generate_many(requests), off.generate_many(requests)):
        same_until_a_near_tie(cached, uncached)
    leader = max(on.members, key=lambda m: m.n_params)
    assert leader.occupancy().prefix.hits >= 3
    idle_and_consistent(on)


def test_a_small_bound_evicts_and_holds(pair):
    with Ensemble(["smollm2-135m"], prefix_cache_cells=120) as small:
        for question in TURNS:
            small.generate([Message("system", SYSTEM), Message("user", question)], **GREEDY)
        held = small.members[0].occupancy()
        assert held.prefix.entries >= 1 and held.prefix.cells <= 120 and held.stray_cells == 0


def test_failed_and_overlong_requests_leave_the_cache_consistent(pair):
    _, on = pair
    with pytest.raises(PromptTooLongError):
        on.generate([Message("system", SYSTEM), Message("user", "word " * 5000)], **GREEDY)
    stream = on.stream([Message("system", SYSTEM), Message("user", TURNS[0])], **{**VOTE, "max_tokens": 64})
    next(stream)  # the first segment: every member is mid-answer
    stream.close()  # the client went away
    idle_and_consistent(on)
    messages = [Message("system", SYSTEM), Message("user", TURNS[0])]
    assert_cached_scores_agree(on, pair[0], messages, [" The library opens at 10 on Saturdays.", " At ten."])
