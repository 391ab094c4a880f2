"""Scores, normalisation, aggregation and winner choice (pure logic)."""

import math

import pytest

from segfuse.engine.scoring import aggregate, normalise, pick_winner, raw_score
from segfuse.types import TokenScores


def ts(*logprobs, logits=None):
    return TokenScores(tuple(logprobs), tuple(logits or logprobs))


def test_mean_prob_is_mean_of_token_probabilities():
    assert raw_score(ts(math.log(0.5), math.log(0.25)), "mean_prob") == pytest.approx(0.375)


def test_mean_logprob_and_logit():
    assert raw_score(ts(-1.0, -3.0), "mean_logprob") == pytest.approx(-2.0)
    assert raw_score(ts(-1.0, -3.0, logits=[10.0, 14.0]), "mean_logit") == pytest.approx(12.0)


def test_unknown_mode_and_empty_scores_are_rejected():
    with pytest.raises(ValueError):
        raw_score(ts(-1.0), "median")  # type: ignore[arg-type]  # not a mode, on purpose
    with pytest.raises(ValueError):
        raw_score(TokenScores((), ()), "mean_prob")


def test_proportional_normalisation_for_probabilities():
    assert normalise([0.2, 0.6, 0.2], "mean_prob") == pytest.approx([0.2, 0.6, 0.2])
    assert normalise([1.0, 3.0], "mean_prob") == pytest.approx([0.25, 0.75])


def test_softmax_normalisation_for_logprobs_equals_geometric_mean_shares():
    a, b = -1.0, -2.0
    expected = [math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b))]
    assert normalise([a, b], "mean_logprob") == pytest.approx(expected)
    # the better (less negative) candidate gets the larger share
    assert normalise([-0.1, -5.0], "mean_logprob")[0] > 0.9


def test_missing_scores_get_zero_and_others_share_the_mass():
    assert normalise([None, 1.0, 3.0], "mean_prob") == pytest.approx([0.0, 0.25, 0.75])
    assert normalise([None, None], "mean_logit") == [0.0, 0.0]


def test_aggregate_weighted_sum_over_verifiers():
    rows = [[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]
    assert aggregate(rows, [1 / 3] * 3) == pytest.approx([1.6 / 3, 1.4 / 3])
    assert aggregate(rows, [0.0, 1.0, 0.0]) == pytest.approx([0.9, 0.1])
    with pytest.raises(ValueError):
        aggregate(rows, [1.0])


def test_ties_go_to_the_lowest_index_and_ineligible_are_skipped():
    assert pick_winner([0.4, 0.4, 0.2]) == 0
    assert pick_winner([0.4, 0.4, 0.2], [False, True, True]) == 1
    with pytest.raises(ValueError):
        pick_winner([0.1], [False])
