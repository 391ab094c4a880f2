"""Hedge weights and Model Exit (pure logic), checked against hand-computed values."""

import math
from dataclasses import replace

import pytest

from segfuse.engine.scoring import ExitRule, hedge_rewards, hedge_update, model_exit, normalised_entropy, softmax

S3 = [[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.4, 0.4, 0.2]]  # S[verifier][candidate]


def test_hedge_rewards_by_hand_with_a_tie():
    # member 0: verifier 2 rates it equal to member 1 (tie counts as a win) and above 2
    assert hedge_rewards(S3) == pytest.approx([2 / 4, 3 / 4, 1 / 4])


def test_hedge_reward_is_floored():
    s = [[0.1, 0.45, 0.45], [0.0, 0.5, 0.5], [0.0, 0.5, 0.5]]
    assert hedge_rewards(s)[0] == pytest.approx(1 / 4)  # no wins -> 1/(K-1)^2


def test_hedge_update_by_hand():
    eta = math.sqrt(1 / 3)  # eta0 = 1, K = 3, t = 1
    raw = [math.exp(eta * r) / 3 for r in (0.5, 0.75, 0.25)]
    expected = [x / sum(raw) for x in raw]
    assert hedge_update([1 / 3] * 3, S3, 1, 1.0) == pytest.approx(expected)
    assert expected == pytest.approx([0.33103, 0.38243, 0.28654], abs=1e-5)


def test_hedge_learning_rate_decays_with_rounds():
    first = hedge_update([1 / 3] * 3, S3, 1, 1.0)
    tenth = hedge_update([1 / 3] * 3, S3, 10, 1.0)
    assert max(tenth) - min(tenth) < max(first) - min(first)
    assert sum(tenth) == pytest.approx(1.0)


def test_hedge_with_two_members_keeps_weights_uniform():
    # With K = 2 the floor 1/(K-1)^2 equals the best reward, so both get reward 1.
    s = [[0.6, 0.4], [0.7, 0.3]]
    assert hedge_rewards(s) == [1.0, 1.0]
    assert hedge_update([0.5, 0.5], s, 1, 1.0) == pytest.approx([0.5, 0.5])


def test_hedge_single_member_is_a_no_op():
    assert hedge_update([1.0], [[1.0]], 1, 1.0) == [1.0]


def test_entropy_and_softmax():
    assert normalised_entropy([1 / 3] * 3) == pytest.approx(1.0)
    assert normalised_entropy([1.0, 0.0, 0.0]) == pytest.approx(0.0)
    assert softmax([1.0, 1.0], 0.5) == pytest.approx([0.5, 0.5])


EXIT = ExitRule(warmup=3, entropy_threshold=0.9, temperature=0.5, fraction=0.5, min_active=1)


def cumulative(rounds):
    """Cumulative quality after each round from per-round aggregate scores."""
    totals = [0.0] * len(rounds[0])
    out = []
    for scores in rounds:
        totals = [t + s for t, s in zip(totals, scores)]
        out.append(list(totals))
    return out


def test_lagging_member_exits_after_warmup():
    history = cumulative([[0.2, 0.45, 0.35]] * 6)
    decisions = [model_exit(q, t + 1, EXIT) for t, q in enumerate(history)]
    assert decisions[0] == decisions[1] == []  # never before warmup
    exit_round = next(t + 1 for t, d in enumerate(decisions) if d)
    assert decisions[exit_round - 1] == [0]
    assert exit_round >= 3


def test_close_race_keeps_everyone():
    history = cumulative([[0.33, 0.34, 0.33]] * 10)
    assert all(model_exit(q, t + 1, EXIT) == [] for t, q in enumerate(history))


def test_never_below_min_active_and_never_the_last_member():
    quality = [0.0, 10.0, 0.0, 0.0]
    assert model_exit(quality, 10, replace(EXIT, min_active=2)) == [0, 2]  # equal shares: lowest index first
    assert len(model_exit(quality, 10, EXIT)) == 3  # one left
    assert model_exit([5.0], 10, EXIT) == []
    assert model_exit([0.0, 9.0], 10, replace(EXIT, min_active=2)) == []
