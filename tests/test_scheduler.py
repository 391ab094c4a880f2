"""Many generations at once on scripted members: batching, inline accepts, cancellation, isolated faults."""

from __future__ import annotations

from fakes import BatchingMember, ScriptedMember, ScriptedSession
from segfuse.engine import fusion_steps
from segfuse.engine.calls import CallRunner
from segfuse.engine.scheduler import Flight, FlightCancelled, Scheduler, run_all
from segfuse.errors import MemberFailedError
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.types import DoneEvent

PLAIN = FusionOptions.build(gate=None, max_tokens=64, temperature=0.0)
WORDS = [([b" one", b"."], False), ([b" two", b"."], False), ([b""], True)]


def session(drafts=WORDS, prefs=None):
    return ScriptedSession(list(drafts), prefs or {" one.": 0.9, " two.": 0.9})


class CountingRunner(CallRunner):
    """Records the methods of every run, to see what ran together."""

    def __init__(self):
        super().__init__()
        self.runs: list[list[str]] = []

    def run(self, calls):
        self.runs.append([c.method for c in calls])
        return super().run(calls)


def steps(members, prompt="q", options=PLAIN):
    return fusion_steps(members, FusionRequest.of(prompt, options))


def test_generations_run_together_with_full_batches_and_accepts_in_between():
    opened = []
    member = BatchingMember("q", factory=lambda messages: opened.append(session()) or opened[-1])
    runner = CountingRunner()
    results = run_all([steps([member], "a"), steps([member], "b")], max_concurrent=2, runner=runner)
    assert [r.text for r in results] == [" one. two.", " one. two."]
    assert set(member.batches) == {("draft", 2)}  # each draft step served both generations in one call
    ticks = [r for r in runner.runs if "draft" in r]
    assert len(ticks) == 3 and all(r == ["draft", "draft"] for r in ticks)
    assert all(s.closed for s in opened)


def test_at_most_max_concurrent_generations_are_in_flight():
    live, peak = [0], [0]

    def open_session(messages):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        s = session()
        close = s.close
        s.close = lambda: (live.__setitem__(0, live[0] - 1), close())
        return s

    member = ScriptedMember("q", factory=open_session)
    results = run_all([steps([member], str(i)) for i in range(5)], max_concurrent=2)
    assert len(results) == 5 and all(r.text == " one. two." for r in results)
    assert peak[0] == 2


def test_a_cancelled_generation_leaves_and_closes_its_sessions_while_the_other_finishes():
    opened = []
    member = ScriptedMember("q", factory=lambda messages: opened.append(session()) or opened[-1])
    ends, done = {}, {}
    scheduler = Scheduler()
    stop = {"b": False}
    for name in ("a", "b"):
        scheduler.add(
            Flight(
                steps([member], name),
                lambda e, n=name: done.setdefault(n, e.result) if isinstance(e, DoneEvent) else None,
                lambda why, n=name: ends.__setitem__(n, why),
                lambda n=name: stop.get(n, False),
            )
        )
    scheduler.tick()
    stop["b"] = True
    while len(scheduler):
        scheduler.tick()
    scheduler.close()
    assert ends["a"] is None and done["a"].text == " one. two."
    assert isinstance(ends["b"], FlightCancelled) and "b" not in done
    assert all(s.closed for s in opened)


def test_a_generation_that_fails_ends_alone():
    broken = ScriptedMember("broken", factory=lambda messages: (_ for _ in ()).throw(OSError("disk gone")))
    healthy = ScriptedMember("q", factory=lambda messages: session())
    outcomes = run_all([steps([broken], "bad"), steps([healthy], "good")], max_concurrent=2)
    assert isinstance(outcomes[0], MemberFailedError) and "disk gone" in str(outcomes[0])
    assert outcomes[1].text == " one. two."


def test_a_batched_fault_in_one_request_drops_that_member_from_that_request_only():
    def open_session(messages):
        s = session()
        if messages[-1].content == "bad":
            s.score = lambda texts: (_ for _ in ()).throw(RuntimeError("scoring failed"))
        return s

    flaky = BatchingMember("flaky", factory=open_session)
    other = [([b" one", b"!"], False), ([b" two", b"!"], False), ([b""], True)]  # texts for the flaky one to score
    steady = ScriptedMember("steady", factory=lambda messages: session(other, {" one!": 0.5, " two!": 0.5}))
    good, bad = run_all([steps([steady, flaky], "good"), steps([steady, flaky], "bad")], max_concurrent=2)
    assert good.text == " one. two." and not good.departures  # the flaky member's drafts won its votes
    assert bad.text == " one! two!"  # it left the other request in round 1: the steady member answered alone
    assert [(d.model, d.kind) for d in bad.departures] == [("flaky", "fault")]
    assert "scoring failed" in bad.departures[0].reason
    assert ("score", 2) in flaky.batches  # the fault happened inside a batched call
