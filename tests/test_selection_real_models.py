"""Selection mechanisms on the three real embedded models (llama.cpp, CPU)."""

from __future__ import annotations

import pytest

from segfuse.engine import fuse
from segfuse.engine.scoring import aggregate, normalise, pick_winner, raw_score
from segfuse.engine.selection import degeneration, guard_eligible
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.types import Message

STORY = [Message("user", "Write two sentences about a cat.")]
LOOP = " The cat sat on the mat."
FRESH = " Then it jumped down and ran outside."
ARITHMETIC = [
    Message("user", "Tom has 3 apples and buys 5 more. How many apples does he have now? Answer with the number.")
]

pytestmark = pytest.mark.models


def test_a_looping_candidate_loses_to_a_fresh_one(default_ensemble):
    """Real verifiers prefer the loop (the likelihood trap); the guard hands the round to the fresh text."""
    answer = LOOP.strip() + LOOP * 2
    candidates = [LOOP, FRESH]
    members = default_ensemble.members
    matrix = []
    for i, member in enumerate(members):
        session = member.start(STORY, seed=i, reserve=64)
        try:
            session.accept(answer)
            scores = session.score(candidates)
        finally:
            session.close()
        matrix.append(normalise([raw_score(s, "mean_prob") for s in scores], "mean_prob"))
    totals = aggregate(matrix, [1 / len(members)] * len(members))
    assert pick_winner(totals) == 0, "the real members no longer prefer the loop: the trap this guard is for"
    penalised = [degeneration(answer, c, LOOP) is not None for c in candidates]
    assert penalised == [True, False]
    assert pick_winner(totals, guard_eligible([True, True], penalised)) == 1


def test_prompt_fit_picks_a_leader_and_the_gate_skips_rounds(default_ensemble):
    options = FusionOptions.build(
        max_tokens=48, temperature=0, exit=False, hedge=False, guard=True, prior="prompt", gate=0.5, accept_margin=None
    )
    result = list(fuse(default_ensemble.members, FusionRequest.of(ARITHMETIC, options)))[-1].result
    names = default_ensemble.names
    assert set(result.prompt_bpb) == set(names)
    assert all(0.1 < v < 10 for v in result.prompt_bpb.values())  # bits per byte of English text
    best = min(result.prompt_bpb, key=result.prompt_bpb.get)
    assert max(result.weights, key=result.weights.get) == best
    largest = max(default_ensemble.members, key=lambda m: m.n_params).name
    assert largest == "qwen2.5-coder-0.5b"
    assert all(r.leader == largest for r in result.rounds)
    gated = [r for r in result.rounds if r.gated]
    assert gated, "a confident leader should win some rounds alone"
    for r in gated:
        assert r.candidates[0].model == largest and r.confidence >= 0.5
        assert r.model_calls == 1  # only the leader drafted
    for r in result.rounds:
        if not r.gated:
            assert len(r.candidates) == len(names) and r.confidence < 0.5
    assert result.stats.gated_rounds == len(gated)
    assert "8" in result.text


def test_gate_with_one_leader_reproduces_the_leader_alone(uncached_ensemble):
    """A gate of 0 accepts every leader draft: the answer is the leader's own greedy answer. (Members with no
    prefix cache: each run reads the prompt afresh, so the two greedy answers agree to the last bit.)"""
    leader = uncached_ensemble.members[1]
    alone = FusionOptions.build(max_tokens=32, temperature=0, exit=False, hedge=False)
    solo = list(fuse([leader], FusionRequest.of(ARITHMETIC, alone)))[-1].result
    gated = FusionOptions.build(max_tokens=32, temperature=0, exit=False, hedge=False, gate=0.0, leader=leader.name)
    fused = list(fuse(uncached_ensemble.members, FusionRequest.of(ARITHMETIC, gated)))[-1].result
    assert fused.text == solo.text
    assert fused.stats.gated_rounds == fused.stats.rounds


INSTRUCTION = [Message("user", "Write a haiku about the sea. Use only lowercase letters.")]


def test_with_margin_zero_the_fused_answer_is_the_leaders_own(default_ensemble):
    """accept_margin 0: the others are never consulted, and the answer is the leader's alone, byte for byte.

    Both deterministic: otherwise the second reads part of its prompt from the prefix cache the first
    left, in two batches instead of one, and llama.cpp's sums in another order can flip a near tie."""
    from segfuse.eval.baselines import write_answer
    from segfuse.types import Sampling

    leader = max(default_ensemble.members, key=lambda m: m.n_params)
    alone = write_answer(leader, INSTRUCTION, max_tokens=96, sampling=Sampling(0.0, 1.0, 0), deterministic=True)
    options = FusionOptions.build(max_tokens=96, temperature=0.0, seed=0, accept_margin=0.0, deterministic=True)
    fused = list(fuse(default_ensemble.members, FusionRequest.of(INSTRUCTION, options)))[-1].result
    assert alone.finish_reason == "stop"  # ended by itself: both answers end at the same place
    assert fused.text == alone.text
    assert all(r.gated and r.winner == leader.name and not r.consulted for r in fused.rounds)
    assert fused.stats.model_calls == fused.stats.rounds  # one draft per round: nobody else was asked


def test_the_leader_scores_the_proposals_and_records_every_verdict(default_ensemble):
    """An unsure leader (gate above 1: it is always unsure) consults; each verdict names its reason."""
    options = FusionOptions.build(max_tokens=24, temperature=0.0, seed=0, gate=1.01, accept_margin=1.0)
    result = list(fuse(default_ensemble.members, FusionRequest.of(INSTRUCTION, options)))[-1].result
    verdicts = [v for r in result.rounds for v in r.consulted.values()]
    assert verdicts and all(v.startswith(("accepted: every token within", "rejected: a token")) for v in verdicts)
    for record in result.rounds:
        rejected = {author for author, v in record.consulted.items() if v.startswith("rejected")}
        assert record.winner not in rejected  # a proposal the leader rejected never wins
        for author in rejected:  # and nobody scored it
            i = [c.model for c in record.candidates].index(author)
            assert all(row[i] is None for row in record.raw_scores.values())
