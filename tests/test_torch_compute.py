"""Where a transformers member computes, and several sessions' drafts in one forward pass per token.

- Every forward pass of a torch member runs on its device's one compute thread (``backends/compute.py``),
  whichever thread calls it: the caller's, or the live path's helper thread that the engine starts for
  every generation whose leader answers alone. Per-thread state (OpenMP's thread count here; cuBLAS
  handles and cuDNN's attention plans on a GPU) is then built once, on that thread.
- ``draft_many`` drafts several sessions in one batched forward pass per token (``backends/transformers/
  batch.py``); each session's cache ends as if it had drafted alone; deterministic sessions draft alone.

Real SmolLM2-135M through transformers (its embedded GGUF, dequantized once into the cache).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from segfuse import Ensemble
from segfuse.backends.registry import load_member
from segfuse.models import get_spec, is_ready
from segfuse.request import to_messages
from segfuse.types import Sampling

pytestmark = pytest.mark.models

if not is_ready(get_spec("smollm2-135m")):
    pytest.skip("SmolLM2-135M is not prepared (`segfuse models prepare`)", allow_module_level=True)

GREEDY = Sampling(temperature=0.0, top_p=1.0, seed=0)
PROMPTS = ("Name three rivers in Europe.", "What is the capital of France?", "Write a haiku about the sea.")


@pytest.fixture(scope="module")
def hf():
    # One torch thread: on a shared 2-core machine, more threads spin against each other.
    member = load_member("transformers:smollm2-135m", threads=1)
    yield member
    member.close()


@pytest.fixture
def forward_threads(hf) -> Iterator[list[int]]:
    """The thread of every forward pass the member runs (its real weights, spied on)."""
    seen: list[int] = []
    real = hf.weights.forward, hf.weights.decode_rows

    def spy(method: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            seen.append(threading.get_ident())
            return method(*args, **kwargs)

        return run

    hf.weights.forward, hf.weights.decode_rows = spy(real[0]), spy(real[1])
    yield seen
    hf.weights.forward, hf.weights.decode_rows = real


def test_a_torch_members_draft_runs_on_its_compute_thread(hf, forward_threads):
    """The leader answers alone with a follower on standby: the live path runs its draft calls on a helper
    thread made for the generation, and the member hands every forward pass to its compute thread."""
    follower = load_member("smollm2-135m", threads=1)  # llama.cpp: never started (standby)
    try:
        ensemble = Ensemble([hf, follower])
        events = list(ensemble.stream("Count from one to five.", max_tokens=12, leader=hf.name, temperature=0.0))
        assert forward_threads, "the member decoded nothing"
        assert set(forward_threads) == {hf.thread.ident}
        assert hf.thread.ident != threading.get_ident()
        result = events[-1].result  # the last event is the DoneEvent
        assert result.counters[hf.name]["draft"] > 0 and follower.name not in result.counters
    finally:
        follower.close()


def test_generations_one_after_another_share_the_thread(hf, forward_threads):
    """A new generation (a new helper thread) reuses the same compute thread: nothing per-thread is rebuilt."""
    ensemble = Ensemble([hf])  # not closed: it would close the module's member
    ensemble.generate("Say hi.", max_tokens=4, temperature=0.0)
    ensemble.generate("Say bye.", max_tokens=4, temperature=0.0)
    assert set(forward_threads) == {hf.thread.ident}


def _omp_threads() -> int:
    info = torch.__config__.parallel_info()
    found = re.search(r"omp_get_max_threads\(\) : (\d+)", info)
    assert found, info
    return int(found.group(1))


def test_the_compute_thread_keeps_the_torch_thread_count(hf):
    """OpenMP reads its thread count per thread: the member's compute thread runs with the count it was
    loaded with (1 here), whatever a new thread would get (every core)."""
    assert hf.compute(_omp_threads) == 1


# --- several sessions in one forward pass per token ------------------------------------------------


def _open(hf, prompt: str, deterministic: bool = False):
    return hf.start(to_messages(prompt), seed=0, reserve=16, deterministic=deterministic)


def _first_tie(rows: list[torch.Tensor], margin: float = 1e-3) -> int:
    """The first step whose two best logits are within `margin`: a greedy pick there may flip between a
    batched and a lone forward pass (their sums differ in the last bits), and everything after it with it."""
    for j, row in enumerate(rows):
        top = torch.topk(row.float(), 2).values
        if float(top[0] - top[1]) < margin:
            return j
    return len(rows)


def test_batched_drafts_match_lone_drafts_and_leave_each_cache_right(hf, forward_threads):
    alone = []
    for prompt in PROMPTS:
        session = _open(hf, prompt)
        draft = session.draft(8, GREEDY)
        alone.append((draft, _first_tie(session.pending.rows)))
        session.close()
    sessions = [_open(hf, p) for p in PROMPTS]
    lone_calls = len(forward_threads)
    drafts = hf.draft_many(sessions, [(8, GREEDY)] * 3)
    assert not any(isinstance(d, Exception) for d in drafts), drafts
    # 7 batched steps for the three (the last sampled token is never fed), plus each prompt's prefill
    assert len(forward_threads) - lone_calls == 7 + len(PROMPTS)
    for (lone, sure), batched in zip(alone, drafts):
        assert batched.pieces[:sure] == lone.pieces[:sure]
        for a, b in zip(batched.logprobs[:sure], lone.logprobs[:sure]):
            assert a == pytest.approx(b, abs=1e-3)
    # each session's cache holds its own draft: scoring a continuation reads it as a fresh session does
    for session, prompt, draft in zip(sessions, PROMPTS, drafts):
        text = b"".join(draft.pieces).decode("utf-8", "replace")
        session.accept(text)
        fresh = _open(hf, prompt)
        fresh.accept(text)
        got, want = session.score([" and so on"])[0], fresh.score([" and so on"])[0]
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)
        fresh.close()
        session.close()


def test_deterministic_sessions_draft_alone(hf):
    calls = []
    real = hf.weights.decode_rows

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])  # the row ids of the batch
        return real(*args, **kwargs)

    hf.weights.decode_rows = spy
    try:
        sessions = [_open(hf, PROMPTS[0], deterministic=True), _open(hf, PROMPTS[1], deterministic=True)]
        sessions.append(_open(hf, PROMPTS[2]))
        drafts = hf.draft_many(sessions, [(6, GREEDY)] * 3)
        assert all(len(d.pieces) == 6 for d in drafts)
        assert calls == []  # two deterministic sessions alone, and a batch of one is a lone draft
        for s in sessions:
            s.close()
        sessions = [_open(hf, p) for p in PROMPTS[:2]] + [_open(hf, PROMPTS[2], deterministic=True)]
        hf.draft_many(sessions, [(6, GREEDY)] * 3)
        assert calls and all(len(ids) == 2 for ids in calls)  # the deterministic one stayed out
        for s in sessions:
            s.close()
    finally:
        hf.weights.decode_rows = real


def test_one_sessions_failure_leaves_the_others_drafting(hf):
    good = [_open(hf, PROMPTS[0]), _open(hf, PROMPTS[1])]
    bad = _open(hf, PROMPTS[2])
    bad.tokens = [*bad.tokens, 10**9]  # a token id past the vocabulary: its prefill fails
    drafts = hf.draft_many([good[0], bad, good[1]], [(4, GREEDY)] * 3)
    assert isinstance(drafts[1], Exception)
    assert len(drafts[0].pieces) == 4 and len(drafts[2].pieces) == 4
    for s in (*good, bad):
        s.close()


def test_many_generations_of_plain_fusion_batch_their_drafts(hf):
    """generate_many with a transformers member: its drafts go through draft_many, the answers complete."""
    batches: list[int] = []
    real = hf.draft_many

    def spy(sessions: Any, requests: Any) -> Any:
        batches.append(len(sessions))
        return real(sessions, requests)

    follower = load_member("smollm2-135m", threads=1, slots=3)  # the ensemble runs as many at once as it has slots
    hf.draft_many = spy
    try:
        ensemble = Ensemble([hf, follower])
        results = ensemble.generate_many(
            list(PROMPTS), max_concurrent=3, max_tokens=16, temperature=0.0, gate=None, accept_margin=None
        )
        assert [r.stats.finish_reason in ("length", "stop") for r in results] == [True] * 3
        assert max(batches) == 3
    finally:
        del hf.draft_many
        follower.close()
