"""The round's pure steps on hand-made inputs: rank (scores -> winner), gate, segment cutting."""

from __future__ import annotations

import math

import pytest

from segfuse.engine.context import GenerationContext, Round
from segfuse.engine.phases import Draft, cut_segment, gate, rank
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.types import Candidate, DraftTokens, TokenScores

PLAIN = FusionOptions.build(gate=None, guard=False, hedge=False, exit=False)


def ctx(options: FusionOptions) -> GenerationContext:
    """A generation's constants under `options` (the phases read the options from it)."""
    return GenerationContext.of(FusionRequest.of("Which colour?", options))


def draft(author: str, text: str, finished: bool = False) -> Draft:
    return Draft(Candidate(author, text, finished, max(1, len(text.split()))), None)


def probs(table: dict[str, dict[str, float]]) -> dict[str, dict[str, TokenScores]]:
    """verifier -> text -> one token of that probability."""
    return {v: {t: TokenScores((math.log(p),), (0.0,)) for t, p in row.items()} for v, row in table.items()}


def test_rank_normalises_per_verifier_and_sums_weighted_votes():
    drafts = [draft("a", " red."), draft("b", " blue."), draft("c", " green.")]
    known = probs(
        {
            "a": {" red.": 0.6, " blue.": 0.3, " green.": 0.1},
            "b": {" red.": 0.2, " blue.": 0.6, " green.": 0.2},
            "c": {" red.": 0.5, " blue.": 0.1, " green.": 0.4},
        }
    )
    ranking = rank(drafts, known, [1 / 3] * 3, ctx(PLAIN), Round(1, "", ""))
    assert ranking.scores["b"] == pytest.approx([0.2, 0.6, 0.2])
    assert ranking.totals == pytest.approx([(0.6 + 0.2 + 0.5) / 3, (0.3 + 0.6 + 0.1) / 3, (0.1 + 0.2 + 0.4) / 3])
    assert ranking.winner == 0
    # A heavy enough voter turns the vote.
    assert rank(drafts, known, [0.1, 0.8, 0.1], ctx(PLAIN), Round(1, "", "")).winner == 1


def test_rank_breaks_ties_towards_the_lowest_member_index():
    drafts = [draft("a", " x."), draft("b", " y.")]
    known = probs({"a": {" x.": 0.5, " y.": 0.5}, "b": {" x.": 0.5, " y.": 0.5}})
    assert rank(drafts, known, [0.5, 0.5], ctx(PLAIN), Round(1, "", "")).winner == 0


def test_without_self_scores_a_member_cannot_vote_for_itself():
    drafts = [draft("a", " A."), draft("b", " B.")]
    known = probs({"a": {" A.": 1.0, " B.": 0.01}, "b": {" A.": 0.6, " B.": 0.4}})
    options = PLAIN.model_copy(update={"self_score": False})
    ranking = rank(drafts, known, [0.5, 0.5], ctx(options), Round(1, "", ""))
    assert ranking.raw["a"][0] is None and ranking.scores["a"] == [0.0, 1.0]
    assert ranking.scores["b"] == [1.0, 0.0]  # b's only vote goes to a's draft
    assert ranking.winner in (0, 1) and ranking.totals[0] == ranking.totals[1]


def test_an_unusable_draft_cannot_win_however_it_scores():
    drafts = [draft("a", ""), draft("b", " fine.")]  # empty and not finished: not eligible
    known = probs({"a": {" fine.": 0.1}, "b": {" fine.": 0.1}})
    ranking = rank(drafts, known, [0.5, 0.5], ctx(PLAIN), Round(1, "", ""))
    assert ranking.raw["a"][0] is None and ranking.winner == 1


def test_the_guard_holds_back_a_candidate_that_repeats_the_last_segment():
    loop = " one two three four."
    drafts = [draft("a", loop), draft("b", " and then five.")]
    known = probs({"a": {loop: 0.95, " and then five.": 0.2}, "b": {loop: 0.9, " and then five.": 0.3}})
    guarded = PLAIN.model_copy(update={"guard": True})
    ranking = rank(drafts, known, [0.5, 0.5], ctx(guarded), Round(2, loop, loop))
    assert ranking.penalised == {"a": "repeats the last segment"} and ranking.winner == 1
    assert not ranking.stuck
    assert rank(drafts, known, [0.5, 0.5], ctx(PLAIN), Round(2, loop, loop)).winner == 0


def test_hedge_moves_the_weights_before_they_are_used():
    drafts = [draft("a", " x."), draft("b", " y."), draft("c", " z.")]
    known = probs({n: {" x.": 0.8, " y.": 0.1, " z.": 0.1} for n in "abc"})
    options = PLAIN.model_copy(update={"hedge": True})
    ranking = rank(drafts, known, [1 / 3] * 3, ctx(options), Round(1, "", ""))
    assert ranking.weights[0] > 1 / 3 and sum(ranking.weights) == pytest.approx(1.0)


def test_gate_passes_a_confident_usable_draft_only():
    confident = Draft(Candidate("q", " Four.", False, 2), TokenScores((math.log(0.9), math.log(0.7)), (0.0, 0.0)))
    options = FusionOptions.build(gate=0.8)
    check = gate(confident, ctx(options), Round(1, ""), patient=True)
    assert check.confidence == pytest.approx(0.8) and check.passes
    assert not gate(confident, ctx(FusionOptions.build(gate=0.81)), Round(1, ""), patient=True).passes
    empty = Draft(Candidate("q", "", False, 0), TokenScores((0.0,), (0.0,)))
    assert not gate(empty, ctx(options), Round(1, ""), patient=True).passes


def test_cut_segment_keeps_whole_words_and_the_authors_scores_of_them():
    tokens = DraftTokens((b" The", b" sky", b" is", b" bl"), (-0.1, -0.2, -0.3, -0.4), (1.0, 2.0, 3.0, 4.0), False)
    cut = cut_segment("m", tokens, "", ())
    assert cut.candidate == Candidate("m", " The sky is", False, 3)
    assert cut.own_scores == TokenScores((-0.1, -0.2, -0.3), (1.0, 2.0, 3.0))
    stopped = cut_segment("m", DraftTokens((b" 4", b".", b"\nQ", b":"), (0.0,) * 4, (0.0,) * 4, False), "", ("\nQ:",))
    assert stopped.candidate.text == " 4." and stopped.candidate.finished and stopped.own_scores is None


# --- the leader's acceptance test -----------------------------------------------------------


def scores(logprobs, tops=None):
    return TokenScores(tuple(logprobs), tuple(logprobs), None if tops is None else tuple(tops))


def test_worst_token_rule_accepts_only_segments_the_leader_nearly_wrote_token_by_token():
    from segfuse.engine.selection import leader_accepts

    near = scores([-0.5, -1.0], [-0.4, -0.6])  # each token within 0.4 nats of the leader's choice
    far = scores([-0.1, -3.0], [-0.1, -0.2])  # one token 2.8 nats below
    assert leader_accepts(near, None, "worst", 0.5).accepted
    assert not leader_accepts(near, None, "worst", 0.3).accepted
    verdict = leader_accepts(far, None, "worst", 1.0)
    assert not verdict.accepted and "2.80 nats" in verdict.reason
    # margin 0: only the leader's own greedy choices pass
    assert leader_accepts(scores([-0.2], [-0.2]), None, "worst", 0.0).accepted
    assert not leader_accepts(scores([-0.21], [-0.2]), None, "worst", 0.0).accepted
    assert not leader_accepts(scores([-0.2]), None, "worst", 5.0).accepted  # no top choices reported


def test_mean_rule_compares_with_the_leaders_own_draft():
    from segfuse.engine.selection import leader_accepts

    own = scores([-0.5, -0.5])
    assert leader_accepts(scores([-1.0, -1.2]), own, "mean", 0.7).accepted  # 0.6 nats below on average
    assert not leader_accepts(scores([-1.0, -1.2]), own, "mean", 0.5).accepted
    assert not leader_accepts(scores([-0.1]), None, "mean", 1.0).accepted
