"""Real llama.cpp members side by side: with ``side_by_side`` on, each member's calls run in a thread of
its own (llama_decode releases the GIL, so two members on two devices decode at once), batched across
requests as before; the answers are those of the members taking turns. On this CPU-only build the
default (auto) resolves to off: the members take turns on the calling thread, and no thread starts."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from segfuse import Ensemble
from segfuse.engine.calls import Call, CallRunner
from segfuse.types import Message, Sampling

pytestmark = pytest.mark.models

MEMBERS = ["smollm2-135m", "gemma3-270m"]
PLAIN = {"gate": None, "accept_margin": None, "exit": False, "hedge": False}  # both members draft and vote
ASK = dict(max_tokens=24, temperature=0.0, seed=0, window=6, **PLAIN)
GREEDY = Sampling(0.0, 1.0, 0)


@pytest.fixture(scope="module")
def side_by_side():
    with Ensemble(MEMBERS, side_by_side=True, threads=1, n_ctx=1024, slots=2) as ensemble:
        yield ensemble


def taking_turns(ensemble: Ensemble, on: bool) -> None:
    for member in ensemble.members:
        member.capabilities = dataclasses.replace(member.capabilities, parallel_safe=on)


class Threads:
    """The thread of every batched and single draft of each member (wrapping the real calls)."""

    def __init__(self, ensemble: Ensemble) -> None:
        self.seen: dict[str, set[str]] = {m.name: set() for m in ensemble.members}
        self.batches: dict[str, list[int]] = {m.name: [] for m in ensemble.members}
        for member in ensemble.members:
            self._wrap(member)

    def _note(self, member) -> None:
        self.seen[member.name].add(threading.current_thread().name)

    def _wrap(self, member) -> None:
        draft_many, open_session = member.draft_many, member.open_session

        def batched(sessions, requests):
            self._note(member)
            self.batches[member.name].append(len(sessions))
            return draft_many(sessions, requests)

        def opened(*args, **kwargs):
            session = open_session(*args, **kwargs)
            draft = session.draft

            def noted(*a, **k):
                self._note(member)
                return draft(*a, **k)

            session.draft = noted
            return session

        member.draft_many, member.open_session = batched, opened


def test_the_option_reaches_the_members_and_auto_is_off_on_the_cpu(side_by_side, default_ensemble):
    assert all(m.capabilities.parallel_safe for m in side_by_side.members)
    assert not any(m.capabilities.parallel_safe for m in default_ensemble.members)  # auto, every layer on the CPU


def test_two_members_decode_in_two_threads_at_once(side_by_side):
    """Each member's draft waits at a barrier for the other's: both are in flight together, or it breaks."""
    barrier = threading.Barrier(2, timeout=60)
    seen: dict[str, str] = {}
    sessions = [m.start([Message("user", "Count to five.")], seed=0, reserve=8) for m in side_by_side.members]

    def meeting(member, session):
        draft = session.draft

        def draft_after_meeting(n, sampling):
            seen[member.name] = threading.current_thread().name
            barrier.wait()
            return draft(n, sampling)

        session.draft = draft_after_meeting

    try:
        for member, session in zip(side_by_side.members, sessions):
            meeting(member, session)
        with CallRunner() as runner:
            replies = runner.run([Call(m, s, "draft", (4, GREEDY)) for m, s in zip(side_by_side.members, sessions)])
    finally:
        for session in sessions:
            session.close()
    assert not any(r.failed for r in replies), [r.value for r in replies]
    assert all(len(r.value.pieces) == 4 for r in replies)
    assert len(set(seen.values())) == 2 and threading.current_thread().name not in seen.values()


def test_a_greedy_fused_answer_is_the_same_side_by_side_as_in_turns(side_by_side):
    threads = Threads(side_by_side)
    beside = side_by_side.generate("Name three colours.", **ASK)
    here = threading.current_thread().name
    assert all(names and here not in names for names in threads.seen.values())  # drafted in worker threads
    taking_turns(side_by_side, False)
    try:
        threads = Threads(side_by_side)
        in_turns = side_by_side.generate("Name three colours.", **ASK)
    finally:
        taking_turns(side_by_side, True)
    assert all(names == {here} for names in threads.seen.values())
    assert beside.text == in_turns.text and beside.text


def test_requests_are_still_batched_per_member_side_by_side(side_by_side):
    prompts = ["Name three colours.", "Name three animals."]
    threads = Threads(side_by_side)
    beside = side_by_side.generate_many(prompts, max_concurrent=2, **ASK)
    assert all(max(sizes) == 2 for sizes in threads.batches.values())  # both requests' drafts in one call
    here = threading.current_thread().name
    assert all(names and here not in names for names in threads.seen.values())
    taking_turns(side_by_side, False)
    try:
        in_turns = side_by_side.generate_many(prompts, max_concurrent=2, **ASK)
    finally:
        taking_turns(side_by_side, True)
    assert [r.text for r in beside] == [r.text for r in in_turns]
