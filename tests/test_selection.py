"""Selection that weak members cannot hijack: pure functions on hand-made inputs."""

import math

import pytest

from segfuse.engine.scoring import ExitRule, aggregate, model_exit, normalise, pick_winner
from segfuse.engine.selection import (
    bits_per_byte,
    continues_loop,
    cross_quality,
    degeneration,
    gate_passes,
    guard_eligible,
    loops,
    mean_probability,
    pick_leader,
    prompt_weights,
    repeat_share,
)

LOOPING_ANSWER = "She has 5 apples. Then she buys 3 more apples. Then she buys 3 more apples. Then she buys 3 more"
LAP = " apples. Then she buys 3 more"


def test_repeat_share_counts_ngrams_completed_by_the_candidate():
    assert repeat_share(LOOPING_ANSWER, LAP, n=6, times=2) == 1.0
    assert repeat_share(LOOPING_ANSWER, LAP, n=6, times=3) < 0.2  # most of its 6-grams were seen twice, not thrice
    assert repeat_share(LOOPING_ANSWER, " apples. So 5 + 3 = 8 apples in total.", n=4) < 0.2
    assert repeat_share("", "a b") == 0.0  # completes no n-gram: cannot tell


def test_repeat_share_judges_a_segment_with_its_context():
    # "she buys 3 more" spans the boundary: it ends in the candidate and was seen before.
    share = repeat_share("She buys 3 more apples. Then she buys 3", " more pears today", n=4)
    assert share == pytest.approx(1 / 3)


def test_a_looping_candidate_is_penalised_and_a_fresh_one_is_not():
    assert "6-grams" in degeneration(LOOPING_ANSWER, LAP, "")
    assert degeneration(LOOPING_ANSWER, " apples. So 5 + 3 = 8 apples.", " more apples.") is None


def test_a_stutter_of_the_last_segment_is_penalised():
    assert (
        degeneration("Janet lays 16 eggs per day.", " She eats three eggs.", " She eats three eggs.")
        == "repeats the last segment"
    )


def test_restating_a_phrase_once_is_not_a_loop():
    # Math answers name the same quantity again: that must not count as degeneration.
    answer = "Janet lays 16 eggs per day. Step 2: find the number of eggs Janet lays per day."
    assert degeneration(answer, " The number of eggs Janet lays per day is 16.", " per day.") is None


def test_short_candidates_are_not_penalised_but_count_as_continuing_a_loop():
    # "8." twice can be fine, and two words are too little to hold a candidate back on ...
    assert degeneration("The answer is 8. The answer is 8.", " 8.", " 8.") is None
    loop = "SOFTWARE ENGINEER, " * 6
    assert degeneration(loop, " SOFTWARE ENGINEER,", "") is None
    # ... but winning with them keeps the answer in its loop (guard patience counts that).
    assert continues_loop(loop, " SOFTWARE ENGINEER,")
    assert not continues_loop(loop, " and a designer.")
    assert not continues_loop(loop, "")


def test_the_looping_candidate_loses_even_with_the_best_score():
    candidates = [LAP, " apples. So she has 8 apples."]
    matrix = [normalise([0.9, 0.3], "mean_prob"), normalise([0.8, 0.4], "mean_prob")]
    totals = aggregate(matrix, [0.5, 0.5])
    assert pick_winner(totals) == 0  # mean probability alone prefers the loop
    penalised = [degeneration(LOOPING_ANSWER, c, "") is not None for c in candidates]
    assert penalised == [True, False]
    assert pick_winner(totals, guard_eligible([True, True], penalised)) == 1


def test_the_guard_steps_aside_when_every_candidate_loops():
    assert guard_eligible([True, True], [True, True]) == [True, True]
    assert guard_eligible([True, False], [True, False]) == [True, False]
    assert guard_eligible([True, True, False], [True, False, False]) == [False, True, False]


EXIT_RULE = ExitRule(warmup=3, entropy_threshold=0.99, temperature=0.1, fraction=0.5, min_active=1)


def qualities(matrix: list[list[float]], rounds: int = 1) -> tuple[list[float], list[float]]:
    """Three members' qualities after `rounds` rounds of the same votes, weighted alike: from all the votes,
    and from the other members' votes only (cross)."""
    weights = [1 / 3] * 3
    all_votes = [rounds * q for q in aggregate(matrix, weights)]
    return all_votes, [rounds * cross_quality(matrix, weights, i) for i in range(3)]


def test_a_self_praising_member_is_not_kept_by_its_own_votes():
    # Member 2 rates its own draft 0.9; the others rate it lowest.
    matrix = [
        [0.5, 0.4, 0.1],
        [0.4, 0.5, 0.1],
        [0.05, 0.05, 0.9],
    ]
    all_votes, cross = qualities(matrix)
    assert all_votes[2] > all_votes[1]  # with its self-vote it looks better than member 1
    assert cross[2] < cross[1] and cross[2] == pytest.approx(0.1)
    leaving = model_exit(cross, 3, EXIT_RULE)
    assert 2 in leaving


def test_the_strongest_member_is_not_exited_on_cross_votes():
    # Member 0 (strong) writes specific text that the weak members 1 and 2 rate modestly while
    # each praises its own draft. On all votes member 0 lags and is exited; on cross-votes it leads.
    matrix = [
        [0.5, 0.25, 0.25],
        [0.2, 0.7, 0.1],
        [0.2, 0.1, 0.7],
    ]
    rounds = 4
    all_q, cross_q = qualities(matrix, rounds)
    assert model_exit(all_q, rounds, EXIT_RULE) == [0]
    assert cross_q[0] == max(cross_q)
    assert 0 not in model_exit(cross_q, rounds, EXIT_RULE)


def test_cross_quality_uses_the_other_voters_weights():
    matrix = [[0.9, 0.1], [0.2, 0.8]]
    assert cross_quality(matrix, [0.5, 0.5], 0) == pytest.approx(0.2)
    assert cross_quality(matrix, [0.5, 0.5], 1) == pytest.approx(0.1)
    three = [[0.0, 0.5, 0.5], [0.2, 0.0, 0.8], [0.6, 0.4, 0.0]]
    assert cross_quality(three, [0.5, 0.25, 0.25], 0) == pytest.approx((0.25 * 0.2 + 0.25 * 0.6) / 0.5)


def test_bits_per_byte():
    assert bits_per_byte(-math.log(2.0) * 8, 8) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bits_per_byte(-1.0, 0)


def test_prompt_weights_order_follows_bits_per_byte():
    weights = prompt_weights([1.2, 0.9, 1.5], temperature=0.1)
    assert sum(weights) == pytest.approx(1.0)
    assert weights[1] > weights[0] > weights[2]
    assert pick_leader(weights) == 1
    flat = prompt_weights([1.2, 0.9, 1.5], temperature=100.0)
    assert max(flat) - min(flat) < 0.01  # a hot softmax is nearly uniform
    with pytest.raises(ValueError):
        prompt_weights([1.0], temperature=0.0)


def test_leader_ties_go_to_the_first_listed():
    assert pick_leader([0.4, 0.4, 0.2]) == 0
    assert pick_leader([0.2, 0.4, 0.4]) == 1


def test_gate_threshold_is_inclusive():
    assert gate_passes(0.5, 0.5)
    assert not gate_passes(0.4999, 0.5)
    assert gate_passes(1.0, 0.0)
    assert not gate_passes(1.0, 1.01)  # above 1: every round is a full round


def test_mean_probability_of_a_draft():
    assert mean_probability([math.log(0.5), math.log(1.0)]) == pytest.approx(0.75)
    assert mean_probability([]) == 0.0


def test_loop_detector():
    assert loops("a b c d e f g h " * 3)
    assert not loops("The answer is 8. " * 2)
    assert not loops("one two three four five six seven eight nine ten eleven twelve")
