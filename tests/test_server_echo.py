"""Echoed prompts through the server: the prompt's tokens with their log-probabilities, as lm-eval's
multiple-choice tasks ask for them (`echo`, `logprobs`, `max_tokens` 1 or 0), token-array prompts,
the tokenizer routes, and lm-eval's own `local-completions` against it.

One `segfuse serve` with the embedded members and no prefix cache serves the module; the in-process
scores it is compared with come from the same members with no prefix cache either.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from helpers import checked_server
from lm_eval_cli import run_lm_eval
from segfuse.eval.bigbench import items

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "src" / "segfuse" / "eval" / "lm_eval_tasks"
SMOL = "smollm2-135m"
LEADER = "qwen2.5-coder-0.5b"  # the largest embedded member: segfuse's echo is on its tokens
CONTEXT, CHOICE = "Question: What is the capital of France?\nAnswer:", " Paris, on the Seine."
# A member's echo reads context and choice in one batch, its score in two: the same sums in another order.
# SmolLM2's numbers agree to the last bits on this machine; Gemma 3's differ by up to ~0.1 nats a token. The
# bound leaves room for another CPU's kernels; a token read at the wrong place would be off by nats.
SAME_MEMBER = 1e-2
POOLED = 0.6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with checked_server(tmp_path_factory.mktemp("echo"), max_concurrent=1, prefix_cache_cells=0) as running:
        yield running


def echo(http, prompt, path: str = "/v1/completions", **extra) -> dict:
    reply = http.post(path, json={"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def after(choice: dict, text: str) -> float:
    """The summed log-probability of the entries after `text`'s characters (lm-eval's sum after ctxlen)."""
    lp = choice["logprobs"]
    return sum(v for v, at in zip(lp["token_logprobs"], lp["text_offset"]) if at >= len(text))


def test_a_members_echo_is_its_own_reading_of_the_text(http, uncached_ensemble):
    choice = echo(http, CONTEXT + CHOICE, f"/m/{SMOL}/v1/completions")
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] == CONTEXT + CHOICE
    tokens = http.post(f"/m/{SMOL}/tokenize", json={"prompt": CONTEXT + CHOICE, "add_special_tokens": False})
    assert len(lp["tokens"]) == tokens.json()["count"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert len(top) == 2 and value <= max(top.values()) + 1e-9 and value < 0
        assert list(top.values()) == sorted(top.values(), reverse=True)
    own = uncached_ensemble.score(CONTEXT, [CHOICE], members=[SMOL]).members[SMOL][0]
    assert after(choice, CONTEXT) == pytest.approx(own.logprob, abs=SAME_MEMBER)


def test_the_ensembles_echo_pools_every_member_on_the_leaders_tokens(http, uncached_ensemble):
    choice = echo(http, CONTEXT + CHOICE)
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == CONTEXT + CHOICE
    leader = http.post("/tokenize", json={"prompt": CONTEXT + CHOICE, "add_special_tokens": False}).json()
    assert len(lp["tokens"]) == leader["count"]
    assert http.get("/tokenizer_info").json()["tokenizer_of"] == LEADER
    scores = uncached_ensemble.score(CONTEXT, [CHOICE], rule="loglinear-whole")
    mean = sum(s[0].logprob for s in scores.members.values()) / len(scores.members)
    assert after(choice, CONTEXT) == pytest.approx(mean, abs=POOLED)
    leader_alone = uncached_ensemble.score(CONTEXT, [CHOICE], members=[LEADER]).members[LEADER][0].logprob
    assert abs(after(choice, CONTEXT) - leader_alone) > POOLED  # the others' readings count


def test_token_ids_read_as_the_text_they_spell_and_an_answer_follows(http):
    ids = http.post("/tokenize", json={"prompt": CONTEXT, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == CONTEXT
    by_text, by_ids = echo(http, CONTEXT), echo(http, ids)
    assert by_ids["logprobs"] == by_text["logprobs"] and by_ids["text"] == CONTEXT
    answered = echo(http, ids, max_tokens=1, temperature=0)
    lp = answered["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and "".join(lp["tokens"]) == answered["text"]
    assert answered["text"].startswith(CONTEXT) and len(answered["text"]) > len(CONTEXT)
    assert lp["token_logprobs"][: len(ids)] == by_text["logprobs"]["token_logprobs"]
    assert lp["text_offset"][-1] == len(CONTEXT)


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "stream"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 422, None),
        ("/v1/completions", {"prompt": [10**7], "echo": True, "logprobs": 1}, 400, "prompt"),
        ("/v1/completions", {"prompt": [-3]}, 422, "prompt"),
        ("/v1/completions", {"prompt": "word " * 5000, "echo": True, "logprobs": 1, "max_tokens": 0}, 400, None),
        ("/m/nobody/v1/completions", {"prompt": "x"}, 404, "model"),
        (f"/m/{SMOL}/v1/completions", {"prompt": "x", "model": "segfuse"}, 400, "model"),
        ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
        ("/tokenize", {"prompt": "x", "extra": 1}, 400, "extra"),
    ],
)
def test_bad_echo_and_token_input_gets_a_clear_error(http, path, body, status, param):
    reply = http.post(path, json={"max_tokens": 1, **body} if "completions" in path else body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error
    assert http.get("/health").json()["status"] == "ok"


# --------------------------------------------------------------------------- lm-eval's local-completions

TASK = "arithmetic-2_digit_addition"
LIMIT = 2


def lm_eval_served(server, out: Path, path: str, model: str) -> list[dict]:
    """lm-eval's own `local-completions` on the task's first items, tokenizing through the server."""
    args = (
        f"base_url={server.url}{path}/v1/completions,model={model},tokenizer_backend=remote,"
        f"auth_token={server.api_key},num_concurrent=1,max_retries=1"
    )
    done = run_lm_eval(
        "lm_eval",
        "local-completions",
        args,
        "segfuse_bigbench_" + TASK.replace("-", "_"),
        LIMIT,
        *("--include_path", str(TASKS), "--log_samples", "--output_path", str(out)),
        env={**os.environ, "OPENAI_API_KEY": server.api_key},
        timeout=800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [samples] = out.rglob("samples_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def served_scores(sample: dict) -> list[float]:
    return [float(resp[0][0]) for resp in sample["resps"]]


def test_lm_eval_local_completions_scores_as_the_members_do(server, uncached_ensemble, tmp_path):
    pooled = lm_eval_served(server, tmp_path / "pooled", "", "segfuse")
    alone = lm_eval_served(server, tmp_path / "alone", f"/m/{SMOL}", SMOL)
    for sample, one, item in zip(pooled, alone, items(TASK, 0, LIMIT)):
        own = uncached_ensemble.score(item.context, list(item.choices), rule="loglinear-whole")
        # A member alone: its own log-likelihoods (lm-eval's split of context and choice is the member's).
        assert served_scores(one) == pytest.approx([s.logprob for s in own.members[SMOL]], abs=SAME_MEMBER)
        # The ensemble: the members' mean, attributed to the leader's tokens; the same choice wins.
        assert served_scores(sample) == pytest.approx(own.fused, abs=POOLED)
        assert max(range(len(own.fused)), key=own.fused.__getitem__) == max(
            range(len(own.fused)), key=served_scores(sample).__getitem__
        )
        assert sample["acc"] == float(own.best in item.correct)
    assert all(not math.isnan(v) for s in pooled for v in served_scores(s))


def test_token_ids_outside_a_vocabulary_are_refused_before_any_decode(uncached_ensemble):
    """llama.cpp aborts the process on an id outside its vocabulary: the member refuses it first."""
    from segfuse.errors import InvalidRequestError

    leader = next(m for m in uncached_ensemble.members if m.name == LEADER)
    for ids in ([10**7], [-1], [1, 2, leader.vocab.n_vocab]):
        with pytest.raises(InvalidRequestError, match="is not in"):
            uncached_ensemble.echo(ids)
        with pytest.raises(InvalidRequestError, match="is not in"):
            leader.detokenize(ids)
