"""Several items scored at once: members loaded with slots score their items' choices in shared decodes,
with the scores of one item at a time (to kernel noise), each item's failure its own, and no slot kept."""

from __future__ import annotations

import math

import pytest

from segfuse import Ensemble
from segfuse.backends.likelihood import score_batches
from segfuse.backends.registry import load_member
from segfuse.errors import InvalidRequestError, PromptTooLongError
from segfuse.eval.bigbench import items
from segfuse.eval.lm_eval_scoring import LikelihoodScoring
from segfuse.likelihood import ItemScores, Rule, score_item, score_items
from segfuse.member_options import MemberOptions

pytestmark = pytest.mark.models

SLOTS = 3
NOISE = 2e-3  # nats
# llama.cpp's CPU kernels round differently with the shape of a decode: the same tokens decoded with others
# beside them move by up to a few tenths of a nat (measured on arithmetic items 100-110, 4 slots, against
# one item at a time: smollm2-135m 0.34, gemma3-270m 0.28, qwen2.5-coder-0.5b 0.22; gemma3-270m moves
# already in parts of 4 tokens). Decoded one token at a time (SMALL rows per decode), batched and one
# at a time agree to the last digit: the exact checks decode so; the lm-eval one, as served, to LOOSE.
SMALL = 1
LOOSE = 0.5


def spy_batches(member, monkeypatch) -> list[int]:
    """Record how many sessions each of `member`'s real ``score_many`` calls served."""
    sizes: list[int] = []
    real = member.score_many

    def recording(sessions, requests):
        sizes.append(len(sessions))
        return real(sessions, requests)

    monkeypatch.setattr(member, "score_many", recording)
    return sizes


def assert_same(batched: ItemScores, alone: ItemScores) -> None:
    assert (batched.context, batched.choices) == (alone.context, alone.choices)
    assert list(batched.members) == list(alone.members)
    for name, row in alone.members.items():
        for b, a in zip(batched.members[name], row, strict=True):
            assert (b.tokens, b.bytes) == (a.tokens, a.bytes)
            assert b.logprob == pytest.approx(a.logprob, abs=NOISE)
    assert batched.fused == pytest.approx(alone.fused, abs=NOISE)


@pytest.fixture(scope="module")
def slotted():
    """The three embedded members, each holding SLOTS sessions, with no prefix cache."""
    ensemble = Ensemble(threads=1, prefix_cache_cells=0, slots=SLOTS)
    yield ensemble
    ensemble.close()


def test_real_items_batched_score_as_one_at_a_time(slotted, monkeypatch):
    chosen = [(i.context, list(i.choices)) for i in items("arithmetic-2_digit_addition", 100, 103)]
    for m in slotted.members:
        monkeypatch.setattr(m.context, "max_outputs", SMALL)
    sizes = spy_batches(slotted.members[0], monkeypatch)
    batched = slotted.score_many(chosen, rule="loglinear-byte")
    assert sizes and max(sizes) == SLOTS  # the three items' choices went to the member together
    sizes.clear()
    alone = [slotted.score(context, choices, rule="loglinear-byte") for context, choices in chosen]
    assert max(sizes) == 1
    for b, a in zip(batched, alone, strict=True):
        assert isinstance(b, ItemScores)
        assert_same(b, a)
        assert set(b.seconds) == set(slotted.names) and all(s > 0 for s in b.seconds.values())
    assert all(m.occupancy().free_slots == SLOTS for m in slotted.members)


def test_lm_eval_scoring_batches_by_the_members_slots(slotted):
    chosen = items("arithmetic-2_digit_addition", 103, 105)
    requests = [(i.context, c) for i in chosen for c in i.choices]
    batched = LikelihoodScoring.build(slotted, "segfuse", Rule.parse("loglinear-whole"))
    assert batched.batch == SLOTS
    one = LikelihoodScoring(batched.members, batched.rule, batch=1)
    got, expected = batched.loglikelihood(requests), one.loglikelihood(requests)
    assert [v for v, _ in got] == pytest.approx([v for v, _ in expected], abs=LOOSE)
    texts = ["The cat sat on the mat.", "Two plus two is four."]
    assert batched.rolling(texts) == pytest.approx(one.rolling(texts), abs=LOOSE)


@pytest.fixture(scope="module")
def member():
    """smollm2-135m with SLOTS sessions: its decodes of under 64 tokens round alike whatever their shape."""
    loaded = load_member("smollm2-135m", MemberOptions(threads=1, prefix_cache_cells=0, slots=SLOTS))
    yield loaded
    loaded.close()


def test_each_items_failure_is_its_own_and_no_slot_is_kept(member, monkeypatch):
    context = "Q: What is 80 plus 29?\nA:"
    many = [f" {n}" for n in range(100, 110)]  # two groups of choices
    long_text = " word" * 600  # over one batch (n_batch 512 tokens): scored in pieces
    given = [
        (context, [" 109", " 108"]),
        ("word " * 5000, [" a"]),
        (context, []),
        ("Q: Name a colour.\nA:", [*many, long_text]),
    ]
    sizes = spy_batches(member, monkeypatch)
    out = score_items([member], given)
    assert max(sizes) == 2  # the context over the window took no part in the decode
    assert isinstance(out[1], PromptTooLongError) and "smollm2-135m" in out[1].message
    assert isinstance(out[2], InvalidRequestError) and "no choices" in out[2].message
    assert isinstance(out[0], ItemScores) and isinstance(out[3], ItemScores)
    assert_same(out[0], score_item([member], *given[0]))
    alone = score_item([member], given[3][0], many).members[member.name]
    assert [s.logprob for s in out[3].members[member.name][:-1]] == pytest.approx([s.logprob for s in alone], abs=NOISE)
    pieces = out[3].members[member.name][-1]
    assert pieces.tokens >= 600 and math.isfinite(pieces.logprob)
    assert member.occupancy().free_slots == SLOTS


def test_a_member_that_does_not_batch_scores_one_item_after_another(member, monkeypatch):
    given = [("Q: 2 plus 2?\nA:", [" 4", " 5"]), ("Q: 3 plus 3?\nA:", [" 6", " 7"])]
    batched = score_batches(member, given)
    monkeypatch.setattr(member, "capabilities", type(member.capabilities)(batched=False))
    sizes = spy_batches(member, monkeypatch)
    one_by_one = score_batches(member, given)
    assert sizes == [1, 1]
    for b, a in zip(batched, one_by_one, strict=True):
        assert [s.logprob for s in b] == pytest.approx([s.logprob for s in a], abs=NOISE)
    assert member.occupancy().free_slots == SLOTS
