"""Log-likelihoods of continuations: real members against their own full-sequence decodes, the
lm-eval boundary, scoring in pieces, greedy flags, pooling rules and bad input."""

from __future__ import annotations

import json
import math

import pytest

from segfuse.backends.likelihood import (
    MAX_PER_CALL,
    ContinuationScore,
    score_continuations,
)
from segfuse.backends.registry import load_member
from segfuse.errors import InvalidRequestError, PromptTooLongError
from segfuse.likelihood import MAX_CHOICES, Rule, score_item, split_boundary
from segfuse.likelihood_weights import ScoredItem, fit_weights, simplex
from segfuse.member_options import MemberOptions
from segfuse.types import Message, Sampling

CONTEXT = "Q: What is 80 plus 29?\nA: "
CHOICES = ["109", "108", "One hundred and nine, of course"]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def member(request):
    """A member of its own, without a prefix cache: the reference decode below clears its cache."""
    loaded = load_member(request.param, MemberOptions(threads=1, prefix_cache_cells=0))
    yield loaded
    loaded.close()


def full_decode(member, context: str, text: str) -> float:
    """The member's summed log-probability of `text` from one decode of context and text together."""
    prompt = member.prompt_tokens([Message("raw", context)])
    cont = member.vocab.encode_continuation(text)
    tokens = prompt + cont
    member.context.seq_rm(0, -1, -1)
    try:
        rows = member.context.decode(tokens, list(range(len(tokens))), [0] * len(tokens), [True] * len(tokens))
        return sum(
            float(rows[len(prompt) + i - 1][t]) - member.softmax.lse(rows[len(prompt) + i - 1])
            for i, t in enumerate(cont)
        )
    finally:
        member.context.seq_rm(0, -1, -1)


@pytest.mark.models
def test_summed_logprob_equals_the_members_full_sequence_decode(member):
    scored = score_item([member], CONTEXT, CHOICES)
    assert scored.context == CONTEXT.rstrip() and scored.choices == [" " + c for c in CHOICES]
    for text, score in zip(scored.choices, scored.members[member.name]):
        reference = full_decode(member, scored.context, text)
        assert score.logprob == pytest.approx(reference, abs=2e-3)
        assert score.tokens == len(member.vocab.encode_continuation(text))
        assert score.bytes == len(text.encode("utf-8"))
    assert scored.seconds[member.name] > 0


@pytest.mark.models
def test_trailing_whitespace_of_the_context_moves_to_the_continuation(member):
    assert split_boundary("Q: hi\nA: \n", ["x"]) == ("Q: hi\nA:", [" \nx"])
    a = score_item([member], CONTEXT, ["109"]).members[member.name][0]
    b = score_item([member], CONTEXT.rstrip(), [" 109"]).members[member.name][0]
    assert a == b


@pytest.mark.models
def test_greedy_flag_marks_the_members_own_greedy_continuation(member):
    session = member.start([Message("raw", CONTEXT.rstrip())], seed=None, reserve=8)
    try:
        drafted = session.draft(3, Sampling(temperature=0.0))
    finally:
        session.close()
    greedy_text = b"".join(drafted.pieces).decode("utf-8")
    assert greedy_text.strip()
    scores = score_continuations(member, CONTEXT.rstrip(), [greedy_text, greedy_text + " zebra quantum"])
    assert scores[0].greedy is True
    assert scores[1].greedy is False


@pytest.mark.models
def test_many_choices_and_a_long_one_are_scored_in_pieces(member):
    many = [f" {n}" for n in range(100, 100 + 2 * MAX_PER_CALL + 1)]  # three calls' worth
    long_text = " word" * 600  # over one batch (n_batch 512 tokens): scored in pieces
    together = score_continuations(member, CONTEXT.rstrip(), [*many, long_text])
    for text, score in zip(many, together):
        alone = score_continuations(member, CONTEXT.rstrip(), [text])[0]
        assert score.logprob == pytest.approx(alone.logprob, abs=2e-3)
    assert together[-1].tokens >= 600 and math.isfinite(together[-1].logprob)
    assert together[-1].bytes == len(long_text)


@pytest.mark.models
def test_bad_input_is_refused_clearly(member):
    with pytest.raises(InvalidRequestError, match="no choices"):
        score_item([member], CONTEXT, [])
    with pytest.raises(InvalidRequestError, match="choice 1 is empty"):
        score_item([member], CONTEXT, ["a", ""])
    with pytest.raises(InvalidRequestError, match="choices given"):
        score_item([member], CONTEXT, ["a"] * (MAX_CHOICES + 1))
    with pytest.raises(InvalidRequestError, match="unknown pooling rule"):
        Rule.parse("geometric")


@pytest.mark.models
def test_a_context_over_the_window_names_the_member():
    small = load_member("smollm2-135m", MemberOptions(threads=1, n_ctx=256, prefix_cache_cells=0))
    try:
        with pytest.raises(PromptTooLongError, match="smollm2-135m"):
            score_item([small], "word " * 400, ["a"])
    finally:
        small.close()


@pytest.mark.models
def test_a_text_over_the_window_is_read_in_rolling_windows():
    """A perplexity text one and a half windows long: every piece is scored, each after the last half window
    of the text before it, where a single window would be full."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test_first1000.jsonl"
    text = " ".join(json.loads(line)["question"] for line in data.read_text().splitlines()[:50])
    member = load_member("smollm2-135m", MemberOptions(threads=1, n_ctx=1600, prefix_cache_cells=0))
    try:
        n_tokens = len(member.tokenize_text(text))
        assert n_tokens > 1.4 * member.n_ctx  # it cannot be read in one window
        with pytest.raises(PromptTooLongError):
            score_item([member], text, ["a"])
        (scored,) = score_continuations(member, "\n", [text])
        assert abs(scored.tokens - n_tokens) < 0.02 * n_tokens  # every piece, in about the text's tokens
        assert -6.0 < scored.logprob / scored.tokens < -0.5  # English read with context, not noise
    finally:
        member.close()


def _score(logprob: float, size: int) -> ContinuationScore:
    return ContinuationScore(logprob, 1, size, None)


def test_pooling_rules():
    members = {"a": [_score(-2.0, 2), _score(-6.0, 6)], "b": [_score(-4.0, 2), _score(-3.0, 6)]}
    assert Rule.parse("loglinear-whole").fuse(members) == [-3.0, -4.5]
    assert Rule.parse("loglinear-byte").fuse(members) == [-1.5, -0.75]
    assert Rule.parse("loglinear-whole", {"a": 3, "b": 1}).fuse(members) == [-2.5, -5.25]
    mixture = Rule.parse("mixture-whole").fuse(members)
    pa = [1 / (1 + math.exp(-4)), math.exp(-4) / (1 + math.exp(-4))]
    pb = [math.exp(-1) / (1 + math.exp(-1)), 1 / (1 + math.exp(-1))]
    assert mixture == pytest.approx([math.log((pa[i] + pb[i]) / 2) for i in range(2)])
    assert sum(math.exp(v) for v in mixture) == pytest.approx(1.0)
    one = Rule.parse("mixture-whole", {"a": 1.0}).fuse(members)
    assert one == pytest.approx([math.log(p) for p in pa])  # only a counts
    with pytest.raises(InvalidRequestError):
        Rule.parse("loglinear-byte", {"a": -1.0}).fuse(members)


def test_fitted_weights_follow_the_member_that_is_right():
    items = [
        ScoredItem({"good": [_score(-1.0, 1), _score(-5.0, 1)], "bad": [_score(-9.0, 1), _score(-1.0, 1)]}, (0,))
        for _ in range(5)
    ]
    weights = fit_weights(Rule.parse("loglinear-whole"), items)
    assert weights["good"] > weights["bad"]
    assert all(Rule("loglinear", "whole", weights).fuse(i.members)[0] > -3 for i in items)
    assert len(simplex(["a", "b", "c"], 0.1)) == 66


@pytest.mark.models
def test_ensemble_score_pools_every_member_and_one_member_is_itself(default_ensemble):
    scored = default_ensemble.score(CONTEXT, CHOICES, rule="loglinear-whole")
    assert set(scored.members) == set(default_ensemble.names)
    expected = [sum(row[i].logprob for row in scored.members.values()) / 3 for i in range(len(CHOICES))]
    assert scored.fused == pytest.approx(expected)
    name = default_ensemble.names[0]
    alone = default_ensemble.score(CONTEXT, CHOICES, rule="loglinear-whole", members=[name])
    assert list(alone.members) == [name]
    assert alone.fused == [s.logprob for s in alone.members[name]]
    with pytest.raises(InvalidRequestError, match="no member named"):
        default_ensemble.score(CONTEXT, CHOICES, members=["nobody"])
