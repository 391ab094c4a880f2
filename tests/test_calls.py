"""Running member calls: one by one, in threads for parallel-safe members, batched where members batch."""

from __future__ import annotations

import threading
import time

import pytest

from fakes import BatchingMember, ScriptedMember, ScriptedSession
from segfuse.backends.base import Capabilities
from segfuse.engine.calls import Call, CallRunner, Calls
from segfuse.types import Sampling

GREEDY = Sampling(0.0, 1.0, 0)


def draft_call(member, session, n=4):
    return Call(member, session, "draft", (n, GREEDY))


def test_replies_come_in_call_order_and_carry_exceptions_instead_of_raising():
    a, b = ScriptedSession([([b" x"], False)], {}), ScriptedSession([], {})
    b.draft = lambda n, s: (_ for _ in ()).throw(ConnectionError("gone"))  # this member's server died
    with CallRunner() as runner:
        replies = runner.run([draft_call(ScriptedMember("a", a), a), draft_call(ScriptedMember("b", b), b)])
    assert replies[0].value.pieces == (b" x",) and not replies[0].failed
    assert replies[1].failed and isinstance(replies[1].value, ConnectionError)


def test_calls_on_the_member_itself_open_sessions():
    session = ScriptedSession([], {})
    member = ScriptedMember("a", session)
    with CallRunner() as runner:
        [reply] = runner.run([Call(member, None, "start", ([],), {"seed": 1, "reserve": 11})])
    assert reply.value is session and member.started == 1


def test_a_batching_member_gets_one_call_for_all_its_sessions():
    member = BatchingMember("q")
    sessions = [ScriptedSession([([b" w"], False)], {}) for _ in range(3)]
    with CallRunner() as runner:
        replies = runner.run([draft_call(member, s) for s in sessions])
        accepted = runner.run([Call(member, s, "accept", (" w",)) for s in sessions])
    assert member.batches == [("draft", 3)]  # accepts are not batched: they decode nothing
    assert all(r.value.pieces == (b" w",) for r in replies)
    assert len({r.seconds for r in replies}) == 1  # every session waited for the whole batch
    assert all(not r.failed for r in accepted) and all(s.accepted == [" w"] for s in sessions)


def test_a_failed_batch_fails_every_session_in_it():
    member = BatchingMember("q")
    member.draft_many = lambda sessions, requests: (_ for _ in ()).throw(RuntimeError("decode failed"))
    sessions = [ScriptedSession([], {}) for _ in range(2)]
    with CallRunner() as runner:
        replies = runner.run([draft_call(member, s) for s in sessions])
    assert all(isinstance(r.value, RuntimeError) for r in replies)


def test_one_session_failing_inside_a_batch_fails_only_that_session():
    member = BatchingMember("q")
    good, bad = ScriptedSession([([b" ok"], False)], {}), ScriptedSession([], {})
    bad.draft = lambda n, s: (_ for _ in ()).throw(ValueError("bad session"))
    with CallRunner() as runner:
        replies = runner.run([draft_call(member, good), draft_call(member, bad)])
    assert replies[0].value.pieces == (b" ok",) and isinstance(replies[1].value, ValueError)


class SlowSession(ScriptedSession):
    def __init__(self, log, lock):
        super().__init__([], {})
        self.log, self.lock = log, lock

    def draft(self, max_tokens, sampling):
        started = time.monotonic()
        time.sleep(0.2)
        with self.lock:
            self.log.append((started, time.monotonic(), threading.current_thread().name))
        return super().draft(max_tokens, sampling)


@pytest.mark.slow
def test_parallel_safe_members_run_at_once_and_local_ones_one_after_another():
    log, lock = [], threading.Lock()
    remote = Capabilities(parallel_safe=True)
    remotes = [ScriptedMember(f"r{i}", capabilities=remote) for i in range(2)]
    with CallRunner() as runner:
        runner.run([draft_call(m, SlowSession(log, lock)) for m in remotes])
        overlapped = log[:]
        log.clear()
        local = [ScriptedMember(f"l{i}") for i in range(2)]
        runner.run([draft_call(m, SlowSession(log, lock)) for m in local])
    (s1, e1, t1), (s2, e2, t2) = overlapped
    assert s1 < e2 and s2 < e1 and t1 != t2  # the two remote drafts overlapped, in worker threads
    (s1, e1, t1), (s2, e2, t2) = sorted(log)
    assert e1 <= s2 and t1 == t2 == threading.current_thread().name  # local drafts ran in turn, here


def test_calls_that_decode_nothing_are_cheap():
    member, session = ScriptedMember("a"), ScriptedSession([], {})
    assert Calls([Call(member, session, "accept", ("x",)), Call(member, session, "close")]).cheap
    assert not Calls([Call(member, session, "accept", ("x",)), draft_call(member, session)]).cheap


class ThreadLog:
    """Which thread ran each batched call of a member, and whether its batches overlapped another member's."""

    def __init__(self, parties):
        self.barrier = threading.Barrier(parties, timeout=10)  # broken unless `parties` calls are in flight at once
        self.threads: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def member(self, name, capabilities):
        log = self

        class Logged(BatchingMember):
            def draft_many(self, sessions, requests):
                with log.lock:
                    log.threads.setdefault(self.name, []).append(threading.current_thread().name)
                if self.capabilities.parallel_safe:
                    log.barrier.wait()
                return super().draft_many(sessions, requests)

            def score_many(self, sessions, requests):
                with log.lock:
                    log.threads.setdefault(self.name, []).append(threading.current_thread().name)
                return super().score_many(sessions, requests)

        member = Logged(name)
        member.capabilities = capabilities
        return member


def test_side_by_side_batching_members_run_their_batches_in_a_thread_each_and_the_rest_here():
    side = Capabilities(parallel_safe=True, batched=True)
    log = ThreadLog(2)
    a, b = log.member("a", side), log.member("b", side)
    cpu = log.member("cpu", Capabilities(batched=True))
    sessions = {m.name: [ScriptedSession([([b" w"], False)], {"": 0.5}) for _ in range(2)] for m in (a, b, cpu)}
    calls = [draft_call(m, s) for m in (a, b, cpu) for s in sessions[m.name]]
    calls += [Call(m, s, "score", ([""],)) for m in (a, b) for s in sessions[m.name]]
    with CallRunner() as runner:
        replies = runner.run(calls)
    assert not any(r.failed for r in replies)  # the barrier held: a's and b's drafts were in flight at once
    assert a.batches == b.batches == [("draft", 2), ("score", 2)]  # still batched across requests
    here = threading.current_thread().name
    assert log.threads["cpu"] == [here]
    for name in ("a", "b"):  # one thread per member for all its calls, not the calling thread
        assert len(set(log.threads[name])) == 1 and log.threads[name][0] != here
    assert log.threads["a"][0] != log.threads["b"][0]


def test_no_thread_when_no_member_runs_side_by_side_or_only_one_lane_has_work():
    log = ThreadLog(1)
    cpu = [log.member(f"cpu{i}", Capabilities(batched=True)) for i in range(2)]
    side = log.member("gpu", Capabilities(parallel_safe=True, batched=True))
    with CallRunner() as runner:
        runner.run([draft_call(m, ScriptedSession([([b" w"], False)], {})) for m in cpu for _ in range(2)])
        runner.run([draft_call(side, ScriptedSession([([b" w"], False)], {})) for _ in range(2)])
        assert runner._pool is None  # no thread was ever started
    here = threading.current_thread().name
    assert all(t == here for threads in log.threads.values() for t in threads)
    assert side.batches == [("draft", 2)]
