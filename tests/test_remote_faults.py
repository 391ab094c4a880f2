"""Remote members on real llama.cpp servers: concurrent calls, and a server killed mid-answer."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server extra is not installed")

from helpers import SessionWrapper, Wrapped
from segfuse import Ensemble, SegmentEvent
from segfuse.backends.registry import load_member
from segfuse.bench.common.processes import llama_cpp_server
from segfuse.models import CATALOGUE, model_path

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]
SMOL = model_path(CATALOGUE["smollm2-135m"])
PROMPT = "Explain in a few sentences how rain forms."


class Timed(Wrapped):
    """Wraps a real member and records when each of its draft calls ran."""

    def __init__(self, member):
        super().__init__(member)
        self.calls: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def start(self, messages, *, seed, reserve):
        return TimedSession(super().start(messages, seed=seed, reserve=reserve), self)

    def close(self):
        self.member.close()


class TimedSession(SessionWrapper):
    def __init__(self, inner, owner: Timed):
        super().__init__(inner)
        self.owner = owner

    def draft(self, max_tokens, sampling):
        t0 = time.monotonic()
        try:
            return self.inner.draft(max_tokens, sampling)
        finally:
            with self.owner.lock:
                self.owner.calls.append((t0, time.monotonic()))


def test_two_remote_members_are_called_concurrently(tmp_path):
    with llama_cpp_server(SMOL, tmp_path / "a.log") as a, llama_cpp_server(SMOL, tmp_path / "b.log") as b:
        members = [Timed(load_member(f"remote:{a.url}#remote-a")), Timed(load_member(f"remote:{b.url}#remote-b"))]
        with Ensemble(members) as ens:
            result = ens.generate(
                PROMPT, max_tokens=24, temperature=0.7, seed=3, exit=False, gate=None
            )  # both draft every round
        assert result.text.strip()
        first, second = members[0].calls, members[1].calls
        assert len(first) == len(second) == result.stats.rounds
        # Each round's two drafts ran at the same time: their intervals overlap.
        for (s1, e1), (s2, e2) in zip(first, second):
            assert s1 < e2 and s2 < e1


def test_server_killed_mid_answer_the_answer_completes_and_the_fault_is_recorded(tmp_path):
    with llama_cpp_server(SMOL, tmp_path / "doomed.log") as server:
        remote = load_member(f"remote:{server.url}#doomed,retries=1,backoff=0.05,timeout=10")
        with Ensemble([remote, "smollm2-135m"]) as ens:
            events = []
            for event in ens.stream(PROMPT, max_tokens=48, temperature=0, seed=0):
                events.append(event)
                if isinstance(event, SegmentEvent) and server.process.poll() is None:
                    server.kill()  # the member's server dies after the first segment
            result = events[-1].result
    faults = [d for d in result.departures if d.kind == "fault"]
    assert [d.model for d in faults] == ["doomed"]
    assert faults[0].round >= 1
    assert result.text.strip()
    assert result.stats.finish_reason in ("stop", "length")
    later = [r for r in result.rounds if r.index > faults[0].round]
    assert later and all(r.active == ["smollm2-135m"] for r in later)
    # The leader answered alone: the local member was on standby, started only when the server died,
    # and read the prompt and the answer so far in one prefill before finishing the answer.
    assert all(r.active == ["doomed"] for r in result.rounds if r.index < faults[0].round)
    local = result.counters["smollm2-135m"]
    assert local["catch_up"] > 0 and local["decode_calls"] <= local["draft"] + len(later) + 2
