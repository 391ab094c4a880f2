"""The SpecFuse loop on the three real embedded models (llama.cpp, CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import PLAIN_FUSION
from segfuse import Ensemble
from segfuse.engine import fuse
from segfuse.errors import MemberLoadError, ModelFileError, PromptTooLongError, UnknownModelError
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.types import Message, Sampling, SegmentEvent

pytestmark = pytest.mark.models

QUESTION = [Message("user", "What is the capital of France? Answer in one short sentence.")]
EXPLAIN = [Message("user", "Explain in a few sentences how rain forms.")]


# llama.cpp's quantized CPU kernels round differently for different batch sizes (one-token
# decodes while drafting, a batch while verifying), so the same token's log-probability
# differs slightly, more for unlikely tokens. Measured on Qwen2.5-0.5B Q4_K_M: up to 0.033
# nats at -0.33 and 0.1 at -9.8; SmolLM2 and Gemma agree within 2e-3. A misaligned or
# cross-contaminated candidate would be off by whole nats. Order within a batch changes nothing.
def close_logprobs(a, b):
    return len(a) == len(b) and all(abs(x - y) <= 0.05 + 0.03 * abs(y) for x, y in zip(a, b))


def run(members, messages=QUESTION, **options):
    options = {**PLAIN_FUSION, **options}  # plain fusion unless a test asks otherwise
    events = list(fuse(members, FusionRequest.of(messages, FusionOptions.build(**options))))
    return events, events[-1].result


def test_greedy_answer_is_coherent_and_fully_recorded(recording):
    events, result = run(recording, max_tokens=40, temperature=0)
    assert "Paris" in result.text
    k = len(recording)
    assert k == 3
    assert "".join(s.text for s in result.segments) == result.text
    streamed = [e.segment.text for e in events if isinstance(e, SegmentEvent)]
    assert "".join(streamed) == result.text
    for record in result.rounds:
        assert len(record.candidates) == k
        assert set(record.scores) == {m.name for m in recording}
        for row in record.scores.values():
            assert len(row) == k
            assert sum(row) == pytest.approx(1.0)
        assert record.winner == record.candidates[record.winner_index].model
    assert result.stats.rounds == len(result.rounds)
    assert sum(result.stats.wins.values()) == result.stats.rounds
    assert result.stats.time_to_first_segment_s is not None
    assert 0 < result.stats.time_to_first_segment_s <= result.stats.total_s


def test_every_member_context_holds_exactly_the_accepted_text(recording):
    _, result = run(recording, EXPLAIN, max_tokens=48, temperature=0.6, seed=3)
    for rec in recording:
        session = rec.sessions[-1]
        answer = b"".join(rec.member.vocab.piece(t) for t in session.answer_tokens()).decode("utf-8")
        assert answer == result.text, rec.name


def test_prefix_is_never_reencoded(recording):
    """Counters: the prompt is decoded once; later rounds decode only new tokens."""
    _, result = run(recording, EXPLAIN, max_tokens=64, temperature=0)
    rounds = result.stats.rounds
    assert rounds >= 3
    window = 10
    for rec in recording:
        session = rec.sessions[-1]
        c = session.counters()
        assert c["prompt"] + c["reused"] == session.prompt_len, rec.name  # reused: from the prefix cache
        # at most the last token of a fully kept own draft is fed again per round
        assert c["catch_up"] <= rounds, (rec.name, c)
        assert c["draft"] <= rounds * (window - 1)
        assert c["verify"] <= rounds * (len(recording) - 1) * window
        accepted = len(session.answer_tokens())
        assert c["prompt"] + c["catch_up"] + c["draft"] + c["verify"] < session.prompt_len + 30 * rounds + accepted


def test_batched_scoring_matches_scoring_each_candidate_alone(default_ensemble):
    texts = [" Paris is the capital.", " It is Paris.", " The capital of France is Paris!"]
    for member in default_ensemble.members:
        session = member.start(QUESTION, seed=0, reserve=64)
        try:
            together = session.score(texts)
            session.accept("")
            alone = []
            for text in texts:
                alone.append(session.score([text])[0])
                session.accept("")
        finally:
            session.close()
        for a, b in zip(together, alone):
            assert close_logprobs(a.logprobs, b.logprobs), (member.name, a.logprobs, b.logprobs)


def test_own_draft_scores_match_verifying_the_same_text(default_ensemble):
    """Self-scores come from drafting; they equal scoring the kept text afresh."""
    from segfuse.segments import cut_draft

    for member in default_ensemble.members:
        session = member.start(QUESTION, seed=0, reserve=64)
        try:
            draft = session.draft(10, Sampling(temperature=0))
            cut = cut_draft(draft.pieces, draft.finished)
            n = cut.n_tokens - (1 if draft.finished else 0)
            session.accept("")
            again = session.score([cut.text])[0]
        finally:
            session.close()
        assert len(again.logprobs) == n, member.name  # greedy drafts are canonical tokenizations
        # Drafting decodes one token at a time, scoring the whole text in one batch: llama.cpp runs the two through
        # different quantised kernels (measured on an AVX-512 machine: one Gemma token 0.1 nat apart), so tokens
        # agree to kernel noise and the mean, which is what the ranking uses, closely.
        mine, theirs = draft.logprobs[:n], again.logprobs
        assert all(abs(x - y) <= 0.15 + 0.03 * abs(y) for x, y in zip(mine, theirs)), (member.name, mine, theirs)
        assert abs(sum(mine) / n - sum(theirs) / n) <= 0.03, (member.name, mine, theirs)


def test_same_seed_same_answer(recording):
    _, first = run(recording, max_tokens=32, temperature=0.8, seed=11)
    _, second = run(recording, max_tokens=32, temperature=0.8, seed=11)
    assert first.text == second.text
    assert [s.model for s in first.segments] == [s.model for s in second.segments]


def test_stop_string_and_token_limit(recording):
    _, result = run(recording, max_tokens=12, temperature=0)
    assert result.stats.tokens <= 12
    assert result.stats.finish_reason in ("length", "stop")
    _, stopped = run(recording, max_tokens=40, temperature=0, stop=["Paris"])
    assert "Paris" not in stopped.text
    assert stopped.stats.finish_reason == "stop"


def test_multi_turn_messages_and_scores_modes(recording):
    messages = [
        Message("system", "You answer with one word."),
        Message("user", "Which planet is known as the red planet?"),
        Message("assistant", "Mars."),
        Message("user", "And the largest planet?"),
    ]
    for mode in ("mean_logprob", "mean_logit"):
        _, result = run(recording, messages, max_tokens=16, temperature=0, score=mode)
        assert result.text.strip()
        assert all(math.isfinite(x) for r in result.rounds for x in r.aggregate)


def test_prompt_longer_than_context_is_a_clear_error(default_ensemble):
    long_prompt = "word " * 5000
    with pytest.raises(PromptTooLongError, match="context"):
        default_ensemble.generate(long_prompt, max_tokens=8)
    # the members are released and keep working
    assert default_ensemble.generate("Say hi.", max_tokens=4, temperature=0).text


def test_bad_member_specs_fail_clearly(tmp_path):
    with pytest.raises(UnknownModelError, match="known models"):
        Ensemble(["no-such-model"])
    with pytest.raises(ModelFileError, match="not found"):
        Ensemble([str(tmp_path / "missing.gguf")])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model at all")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        Ensemble([str(garbage)])
    truncated = tmp_path / "truncated.gguf"
    from segfuse.models import CATALOGUE, model_path

    truncated.write_bytes(model_path(CATALOGUE["smollm2-135m"]).read_bytes()[:200_000])
    with pytest.raises(MemberLoadError, match="could not load"):
        Ensemble([str(truncated)])


def test_gguf_path_member_and_duplicate_names(default_ensemble):
    from segfuse.models import CATALOGUE, model_path

    path = str(model_path(CATALOGUE["smollm2-135m"]))
    with Ensemble([path, path]) as pair:
        assert pair.names[0] != pair.names[1]
        result = pair.generate("Say hello.", max_tokens=8, seed=1)
        assert set(result.stats.wins) == set(pair.names)


def generate_json(*args: str) -> dict:
    """`segfuse generate --json --no-gate ARGS` in a child process: its answer, as JSON."""
    command = [sys.executable, "-m", "segfuse.cli", "generate", "--json", "--no-gate", *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_cli_json_output():
    data = generate_json("--max-tokens", "24", "--seed", "1", "Name three primary colors.")
    assert {"text", "segments", "rounds", "stats"} <= set(data)
    assert len(data["models"]) == 3
    assert all({"text", "model"} <= set(s) for s in data["segments"])
    first = data["rounds"][0]
    assert all({"model", "text", "finished"} <= set(c) for c in first["candidates"])
    assert len(first["scores"]) == 3 and "winner" in first
    assert {"rounds", "model_calls", "time_to_first_segment_s", "total_s"} <= set(data["stats"])


def test_cli_json_with_exit_and_hedge_shows_weights_and_exits_per_round():
    # Default Model Exit knobs on a GSM8K-style question: the lagging members leave after warm-up.
    data = generate_json(
        "--exit",
        "--hedge",
        "--temperature",
        "0",
        "--max-tokens",
        "64",
        "--threads",
        "1",
        "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
    )
    rounds = data["rounds"]
    for r in rounds:
        assert set(r["weights"]) == set(r["active"]) and sum(r["weights"].values()) == pytest.approx(1.0)
    exits = [d for d in data["departures"] if d["kind"] == "exit"]
    assert exits and all(d["round"] >= 3 and "share" in d["reason"] for d in exits)
    assert len(rounds[-1]["active"]) < 3 and rounds[-1]["model_calls"] < rounds[0]["model_calls"]
    assert data["stats"]["model_calls"] / data["stats"]["rounds"] < rounds[0]["model_calls"]


def test_model_exit_forces_members_out_and_the_answer_completes(recording):
    # Aggressive knobs: after one round, members below the average share leave.
    _, result = run(
        recording,
        EXPLAIN,
        max_tokens=48,
        temperature=0,
        exit=True,
        exit_warmup=1,
        exit_entropy=1.0,
        exit_fraction=1.0,
        exit_min_active=1,
    )
    exits = [d for d in result.departures if d.kind == "exit"]
    assert exits, "some member should have exited"
    assert len(exits) <= 2  # never the last member
    assert result.text.strip()
    assert result.stats.finish_reason in ("length", "stop")
    last = result.rounds[-1]
    assert len(last.candidates) == len(last.active) < 3
    assert last.model_calls < 6
    exited = {d.model for d in exits}
    # an exited member neither drafts nor verifies after it left
    for record in result.rounds:
        if record.index > max(d.round for d in exits):
            assert exited.isdisjoint(record.active)
            assert exited.isdisjoint(record.scores)


def test_hedge_weights_move_and_are_reported(recording):
    _, result = run(recording, EXPLAIN, max_tokens=32, temperature=0, hedge=True)
    for record in result.rounds:
        assert sum(record.weights.values()) == pytest.approx(1.0)
    assert len({round(w, 6) for w in result.weights.values()}) > 1


def test_rerank_scores_an_answer_longer_than_one_batch(default_ensemble):
    """A text over n_batch tokens is scored in pieces on a second session, opened after the first closed."""
    from segfuse.backends.likelihood import split_for_scoring
    from segfuse.eval.baselines import score_answers

    qwen = next(m for m in default_ensemble.members if m.name.startswith("qwen"))
    long_text = " ".join(f"step {i}: add {i} and {i + 1} to get {2 * i + 1}." for i in range(90))
    assert len(qwen.vocab.encode_continuation(long_text)) > qwen.context.n_batch
    (short, long), calls = score_answers(qwen, [Message("user", "Add some numbers.")], ["Fine.", long_text])
    assert len(short.logprobs) >= 1 and len(long.logprobs) >= qwen.context.n_batch
    assert calls == 1 + len(split_for_scoring(long_text))
    assert qwen.table.free == qwen.slots  # every session it opened was closed
