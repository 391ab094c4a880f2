"""Members beyond llama.cpp, on real models: transformers on CPU and a remote server on loopback.

- transformers: SmolLM2-135M-Instruct's GGUF (Q4_1) loaded through transformers,
  which dequantizes it; the converted checkpoint is cached under the segfuse
  cache directory, so only the first run pays the conversion (~45 s).
- remote: `python -m llama_cpp.server` (llama-cpp-python's OpenAI-compatible
  server) started on a free loopback port with the same GGUF.

Agreement tolerance, transformers vs llama.cpp on the same GGUF: per-token
probabilities within 0.05 and normalised candidate scores within 0.03. The
weights are identical (dequantized Q4_1), but llama.cpp multiplies Q4_1
weights with activations quantized to 8 bits and accumulates differently.
Measured here: log-probabilities differ by up to 0.32 nats (on unlikely
tokens), probabilities, which the default score averages, by up to 0.032, and
normalised scores by up to 0.014; the winner is the same.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from members import loaded
from segfuse.backends.registry import load_member
from segfuse.bench.common.processes import free_port, llama_cpp_server
from segfuse.engine.scoring import normalise, raw_score
from segfuse.ensemble import Ensemble
from segfuse.errors import MemberLoadError
from segfuse.models import CATALOGUE, is_ready, model_path
from segfuse.types import Message, Sampling

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

SMOL = CATALOGUE["smollm2-135m"]
QWEN = CATALOGUE["qwen2.5-coder-0.5b"]
QUESTION = [Message("user", "What is the capital of France?")]
PREFILLED = [*QUESTION, Message("assistant", "The capital")]  # continued: the prompt ends with it, left open
CANDIDATES = ["The capital of France is Paris.", " Paris is", "It is Lyon, of course", "Paris"]
REPO = Path(__file__).resolve().parents[1]

if not is_ready(SMOL):
    pytest.skip("SmolLM2-135M is not prepared (`segfuse models prepare`)", allow_module_level=True)


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_member():
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    # One torch thread: on a shared 2-core machine, more threads spin against each other (measured 10x slower).
    with loaded("transformers:smollm2-135m", threads=1) as member:
        yield member


@pytest.fixture(scope="module")
def lc_member():
    with loaded("smollm2-135m", threads=1) as member:
        yield member


@pytest.fixture(scope="module")
def server_url(tmp_path_factory) -> Iterator[str]:
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server extra is not installed")
    with llama_cpp_server(model_path(SMOL), tmp_path_factory.mktemp("server") / "smol.log") as server:
        yield server.url


@pytest.fixture(scope="module")
def remote_member(server_url):
    with loaded(f"remote:{server_url}#smol-remote") as member:
        yield member


def _scores(member, texts, *, one_by_one=False):
    if not one_by_one:
        session = member.start(QUESTION, seed=1, reserve=31)
        try:
            return session.score(texts)
        finally:
            session.close()
    return [_scores(member, [t])[0] for t in texts]


# --- transformers ------------------------------------------------------------------------------


def test_transformers_prompt_matches_llama_cpp(hf_member, lc_member):
    """Same chat template and tokenizer metadata -> the very same prompt tokens."""
    assert hf_member.prompt_tokens(QUESTION) == lc_member.prompt_tokens(QUESTION)
    assert hf_member.prompt_tokens(PREFILLED) == lc_member.prompt_tokens(PREFILLED)
    for text in CANDIDATES:
        assert hf_member.vocab.encode_continuation(text) == lc_member.vocab.encode_continuation(text)


def test_transformers_batched_scores_match_one_by_one(hf_member):
    batched = _scores(hf_member, [*CANDIDATES, ""])
    alone = _scores(hf_member, [*CANDIDATES, ""], one_by_one=True)
    for b, a in zip(batched, alone):
        assert len(b.logprobs) == len(a.logprobs)
        assert max(abs(x - y) for x, y in zip(b.logprobs, a.logprobs)) < 1e-4


def test_transformers_scores_match_llama_cpp(hf_member, lc_member):
    hf = _scores(hf_member, CANDIDATES)
    lc = _scores(lc_member, CANDIDATES)
    for h, c in zip(hf, lc):
        assert len(h.logprobs) == len(c.logprobs)
        assert max(abs(math.exp(x) - math.exp(y)) for x, y in zip(h.logprobs, c.logprobs)) < 0.05
    norm_hf = normalise([raw_score(s, "mean_prob") for s in hf], "mean_prob")
    norm_lc = normalise([raw_score(s, "mean_prob") for s in lc], "mean_prob")
    assert max(abs(a - b) for a, b in zip(norm_hf, norm_lc)) < 0.03
    assert norm_hf.index(max(norm_hf)) == norm_lc.index(max(norm_lc))


def test_transformers_cache_survives_rounds(hf_member):
    """Draft, verify, accept own and foreign text: the kept cache scores like a fresh one."""
    session = hf_member.start(QUESTION, seed=3, reserve=31)
    try:
        draft = session.draft(6, Sampling(temperature=0.0))
        session.score([" Paris", "The capital"])
        session.accept(" Paris")  # a verified foreign candidate: its keys/values are appended
        draft = session.draft(6, Sampling(temperature=0.0))
        own = b"".join(draft.pieces[:3]).decode("utf-8")
        session.score([" is nice"])
        session.accept(own)  # part of its own draft: cropped, not recomputed
        assert session.cache.get_seq_length() in (len(session.tokens), len(session.tokens) - 1)
        continued = session.score([" and it is big."])[0]
        counters = session.counters()
        # the prompt ran once (part of it may come from the prefix cache, filled by earlier tests)
        assert counters["prompt"] + counters.get("reused", 0) == len(hf_member.prompt_tokens(QUESTION))

        fresh = hf_member.start(QUESTION, seed=3, reserve=31)
        fresh.tokens = list(session.tokens)
        again = fresh.score([" and it is big."])[0]
        fresh.close()
        assert max(abs(a - b) for a, b in zip(continued.logprobs, again.logprobs)) < 1e-4
    finally:
        session.close()


def test_transformers_prefix_cache_serves_the_next_turn(hf_member):
    """A chat's second turn starts from the first turn's keys and values, and drafts what it drafts cold."""
    greedy = Sampling(temperature=0.0)
    first = [Message("system", "You answer in one short sentence."), Message("user", "Name a primary colour.")]
    session = hf_member.start(first, seed=0, reserve=31)
    answer = b"".join(session.draft(6, greedy).pieces).decode("utf-8", "replace")
    session.accept(answer)
    session.close()
    second = [*first, Message("assistant", answer), Message("user", "Name another one.")]
    hits = hf_member.prefix_cache.stats().hits
    warm = hf_member.start(second, seed=0, reserve=31)
    try:
        assert warm.stats.reused >= len(hf_member.prompt_tokens(first))  # the first turn is not read again
        assert hf_member.prefix_cache.stats().hits == hits + 1
        warm_draft = warm.draft(6, greedy)
    finally:
        warm.close()
    hf_member.prefix_cache.clear()
    cold = hf_member.start(second, seed=0, reserve=31)
    try:
        assert cold.stats.reused == 0
        cold_draft = cold.draft(6, greedy)
    finally:
        cold.close()
    assert warm_draft.pieces[0] == cold_draft.pieces[0]
    same = next(
        (i for i, (a, b) in enumerate(zip(warm_draft.pieces, cold_draft.pieces)) if a != b), len(warm_draft.pieces)
    )
    # the prefix ran in another batch than cold: float rounding only
    assert max(abs(a - b) for a, b in zip(warm_draft.logprobs[:same], cold_draft.logprobs[:same])) < 0.05
    assert hf_member.prefix_cache.stats().cells <= hf_member.prefix_cache.bound
    assert hf_member.occupancy().prefix == hf_member.prefix_cache.stats()


# --- remote ------------------------------------------------------------------------------------


def test_remote_member_detects_server(remote_member):
    assert remote_member.server.kind.name == "llama-cpp-python"
    assert remote_member.server.batch is False  # its server takes one prompt per request
    assert remote_member.source.prompt.style == "chat"  # template read from the served GGUF
    assert "<|im_end|>" in remote_member.source.end_texts


@pytest.mark.parametrize("messages", [QUESTION, PREFILLED], ids=["question", "prefill"])
def test_remote_draft_matches_local_greedy(remote_member, lc_member, messages):
    remote = remote_member.start(messages, seed=1, reserve=31)
    local = lc_member.start(messages, seed=1, reserve=31)
    try:
        r = remote.draft(8, Sampling(temperature=0.0))
        loc = local.draft(8, Sampling(temperature=0.0))
        assert b"".join(r.pieces) == b"".join(loc.pieces)
        assert len(r.pieces) == len(loc.pieces)
        assert max(abs(a - b) for a, b in zip(r.logprobs, loc.logprobs)) < 1e-3
    finally:
        remote.close()
        local.close()


def test_remote_scores_match_local(remote_member, lc_member):
    texts = [*CANDIDATES[:2], ""]
    remote = _scores(remote_member, texts)
    local = _scores(lc_member, texts)
    for r, loc in zip(remote[:2], local[:2]):
        assert len(r.logprobs) == len(loc.logprobs)
        assert max(abs(a - b) for a, b in zip(r.logprobs, loc.logprobs)) < 1e-3
    # "stop here": both sum the end-of-generation tokens' probabilities
    assert abs(remote[2].logprobs[0] - local[2].logprobs[0]) < 1e-3


def test_mixed_local_and_remote_ensemble(server_url):
    with Ensemble([f"remote:{server_url}#smol-remote", "smollm2-135m"], threads=1) as ensemble:
        result = ensemble.generate(
            "Name three primary colors.", max_tokens=16, seed=7, window=8, gate=None
        )  # every round votes
    assert result.text.strip()
    assert result.models == ["smol-remote", "smollm2-135m"]
    assert result.stats.rounds >= 1
    for record in result.rounds:
        assert set(record.raw_scores) == {"smol-remote", "smollm2-135m"}
        assert any(c.model == "smol-remote" for c in record.candidates)


def test_cli_generate_with_remote_member(server_url):
    out = subprocess.run(
        [
            str(Path(sys.executable).with_name("segfuse")),
            "generate",
            "Say hi.",
            "-m",
            f"remote:{server_url}#smol-remote",
            "-m",
            "smollm2-135m",
            "--max-tokens",
            "12",
            "--seed",
            "1",
            "--threads",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["models"] == ["smol-remote", "smollm2-135m"]


def test_remote_refuses_off_by_one_echo(tmp_path):
    """Qwen's prompts do not start with BOS: llama-cpp-python's echo log-probs shift by one
    (abetlen/llama-cpp-python#1983)."""
    if not is_ready(QWEN):
        pytest.skip("Qwen2.5-Coder-0.5B is not prepared")
    pytest.importorskip("llama_cpp.server.app")
    with llama_cpp_server(model_path(QWEN), tmp_path / "qwen.log") as server:
        with pytest.raises(MemberLoadError, match="1983"):
            load_member(f"remote:{server.url}#qwen-remote")


def test_remote_unreachable_server_fails_fast():
    from segfuse.backends.remote.http import RemoteServerError

    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(RemoteServerError, match="2 attempts"):
        load_member(f"remote:http://127.0.0.1:{port}/v1#gone,retries=1,backoff=0.05,timeout=2")
    assert time.monotonic() - started < 10


def test_remote_spec_options():
    from segfuse.backends.remote.member import parse_target

    url, opts = parse_target("http://h:8000/v1#big,model=Qwen/Qwen2.5-72B-Instruct,batch=false,n_ctx=8192")
    assert url == "http://h:8000/v1"
    assert opts == {"name": "big", "model": "Qwen/Qwen2.5-72B-Instruct", "batch": False, "n_ctx": 8192}


def test_ignore_eos_runs_to_the_window(hf_member, remote_member):
    """Sampling.ignore_eos: end-of-generation tokens are banned (transformers: masked; remote: logit bias)."""
    short = [Message("user", "Is the sky blue? Answer yes or no.")]
    for member in (hf_member, remote_member):
        session = member.start(short, seed=1, reserve=31)
        try:
            ended = session.draft(12, Sampling(temperature=0.0))
            session.accept("")
            forced = session.draft(12, Sampling(temperature=0.0, ignore_eos=True))
        finally:
            session.close()
        assert ended.finished  # the question is answered within 12 tokens...
        assert not forced.finished and len(forced.pieces) == 12  # ...unless ending is banned


def test_prompt_fit_prior_falls_back_to_uniform_with_a_remote_member(server_url):
    """Remote members cannot measure prompt fit yet: the prior stays uniform instead of failing."""
    with Ensemble([f"remote:{server_url}#smol-remote", "smollm2-135m"], threads=1) as ensemble:
        result = ensemble.generate("Name a colour.", max_tokens=6, seed=1, prior="prompt", gate=None)
    assert result.prompt_bpb == {}
    assert result.text.strip()
