"""The server's worker on scripted members: admission, the bounded queue, cancellation, outcomes, Hedge carry-over."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fakes import BlockingSession, ScriptedMember, ScriptedSession
from segfuse import Ensemble
from segfuse.backends.base import Occupancy
from segfuse.errors import InvalidRequestError
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.server.worker.jobs import Cancelled, Failed, Job, QueueFullError, Started
from segfuse.server.worker.thread import Worker
from segfuse.types import DoneEvent

WORDS = [([b" one", b"."], False), ([b" two", b"."], False), ([b""], True)]
PLAIN = FusionOptions.build(gate=None, max_tokens=32, temperature=0.0)


def job(text: str, options: FusionOptions = PLAIN, members=None) -> Job:
    return Job(FusionRequest.of(text, options, members=members))


async def outcome(j: Job):
    """The job's items up to its terminal one."""
    return [item async for item in j.items()]


def run_jobs(worker: Worker, jobs: list[Job], before_wait=None):
    async def main():
        loop = asyncio.get_running_loop()
        accepted, refused = [], []
        for j in jobs:
            j.bind(loop)
            try:
                worker.queue.submit(j)
                accepted.append(j)
            except QueueFullError:
                refused.append(j)
        if before_wait:
            await asyncio.to_thread(before_wait, accepted)
        items = await asyncio.wait_for(asyncio.gather(*(outcome(j) for j in accepted)), 10)
        return dict(zip((j.id for j in accepted), items)), refused

    return asyncio.run(main())


@pytest.fixture()
def slow_ensemble():
    """One member whose drafts wait for the test to open `gate`."""
    gate = threading.Event()
    opened: list[ScriptedSession] = []

    def open_session(messages):
        opened.append(BlockingSession(list(WORDS), {}, gate))
        return opened[-1]

    with Ensemble([ScriptedMember("slow", factory=open_session)]) as ensemble:
        yield ensemble, gate, opened


def test_jobs_beyond_the_running_and_the_queue_are_refused(slow_ensemble):
    ensemble, gate, opened = slow_ensemble
    worker = Worker(queue_size=1, max_concurrent=2)
    worker.start(ensemble)

    def while_blocked(accepted):
        deadline = threading.Event()
        for _ in range(100):  # the worker admits two, the third waits
            if worker.queue.state() == (1, 2):
                break
            deadline.wait(0.05)
        assert worker.queue.state() == (1, 2)
        gate.set()

    results, refused = run_jobs(worker, [job(f"q{i}") for i in range(4)], while_blocked)
    worker.stop()
    assert len(refused) == 1 and len(results) == 3
    for items in results.values():
        assert isinstance(items[0], Started) and isinstance(items[-1], DoneEvent)
        assert items[-1].result.text == " one. two."
    counters = worker.queue.snapshot()
    assert (counters["accepted"], counters["rejected"], counters["started"], counters["completed"]) == (3, 1, 3, 3)
    assert all(s.closed for s in opened) and worker.queue.state() == (0, 0)


def test_cancelling_a_queued_and_a_running_job(slow_ensemble):
    ensemble, gate, opened = slow_ensemble
    worker = Worker(queue_size=4, max_concurrent=1)
    worker.start(ensemble)
    jobs = [job("running"), job("queued")]

    def cancel_both(accepted):
        for _ in range(100):
            if worker.queue.state() == (1, 1):
                break
            threading.Event().wait(0.05)
        worker.queue.cancel(jobs[1])  # still in the queue
        worker.queue.cancel(jobs[0])  # in flight: stops at its next step
        gate.set()

    results, _ = run_jobs(worker, jobs, cancel_both)
    worker.stop()
    assert isinstance(results[jobs[1].id][-1], Cancelled) and len(results[jobs[1].id]) == 1
    assert isinstance(results[jobs[0].id][-1], Cancelled)
    assert worker.queue.snapshot()["cancelled"] == 2 and worker.queue.snapshot()["started"] == 1
    assert len(opened) == 1 and opened[0].closed  # the running job's session was released


def test_a_bad_request_is_invalid_and_a_dead_member_is_a_failure():
    def broken(messages):
        raise OSError("the model file vanished")

    with Ensemble(
        [
            ScriptedMember("ok", factory=lambda m: ScriptedSession(list(WORDS), {})),
            ScriptedMember("broken", factory=broken),
        ]
    ) as ensemble:
        worker = Worker(queue_size=4, max_concurrent=2)
        worker.start(ensemble)
        results, _ = run_jobs(worker, [job("x", FusionOptions.build(leader="nobody")), job("y", members=["broken"])])
        worker.stop()
    invalid, failed = results.values()
    assert isinstance(invalid[-1], Failed) and isinstance(invalid[-1].error, InvalidRequestError)
    assert isinstance(failed[-1], Failed) and "vanished" in str(failed[-1].error)
    counters = worker.queue.snapshot()
    assert counters["invalid"] == 1 and counters["failed"] == 1


def test_hedge_weights_carry_from_one_query_to_the_next_through_the_ensemble():
    prefs = {" x.": 0.9}

    def member(name, text):
        return ScriptedMember(name, factory=lambda m: ScriptedSession([([text, b"."], False), ([b""], True)], prefs))

    with Ensemble([member("a", b" x"), member("b", b" y"), member("c", b" z")], hedge_persist=True) as ensemble:
        worker = Worker(queue_size=4, max_concurrent=1)
        worker.start(ensemble)
        options = FusionOptions.build(gate=None, hedge=True, temperature=0.0)
        first, _ = run_jobs(worker, [job("one", options)])
        learned = dict(ensemble.hedge_weights)
        second, _ = run_jobs(worker, [job("two", options)])
        worker.stop()
    assert learned["a"] > learned["b"] and learned == next(iter(first.values()))[-1].result.weights
    # the second query started from the first one's weights: its first round's weights are not uniform
    start = next(iter(second.values()))[-1].result.rounds[0].weights
    assert start["a"] > 1 / 3


class Holding(ScriptedMember):
    """Two slots; each open session holds one slot and ten cache cells until it is closed.
    Every read of what it holds is recorded."""

    def __init__(self):
        super().__init__("holding", factory=self._open, slots=2)
        self.open: list[ScriptedSession] = []
        self.reads: list[Occupancy] = []

    def _open(self, messages):
        self.open.append(ScriptedSession(list(WORDS), {}))
        return self.open[-1]

    def occupancy(self):
        held = sum(not s.closed for s in self.open)
        self.reads.append(Occupancy(slots=2, free_slots=2 - held, cache_cells=10 * held))
        return self.reads[-1]


def test_the_worker_shows_what_members_hold_and_nothing_once_idle():
    member = Holding()
    with Ensemble([member]) as ensemble:
        worker = Worker(queue_size=4, max_concurrent=2)
        worker.start(ensemble)
        assert worker.queue.occupancy() == {"holding": Occupancy(2, 2, 0)}
        run_jobs(worker, [job("a"), job("b")])
        idle = worker.queue.view()  # at once: each result went out after its job let its sessions go
        worker.stop()
    assert Occupancy(2, 0, 20) in member.reads  # read while both generations ran, between steps
    assert idle == (0, 0, {"holding": Occupancy(2, 2, 0)})


ROUNDS = 100  # a race: the more rounds, the likelier a regression shows


def test_a_result_reaches_its_handler_only_once_the_job_is_no_longer_in_flight():
    """Found by a hostile run: /health, asked the moment the last answer ended, showed a slot held with
    nothing in flight (the view of what members hold dated from before the job closed its sessions)."""
    member = Holding()
    with Ensemble([member]) as ensemble:
        worker = Worker(queue_size=8, max_concurrent=2)
        worker.start(ensemble)

        async def main():
            seen = []
            for _ in range(ROUNDS):
                j = job("a")
                j.bind(asyncio.get_running_loop())
                worker.queue.submit(j)
                # what /health reads, as the answer's last frame goes out
                seen += [worker.queue.view() async for item in j.items() if isinstance(item, DoneEvent)]
            return seen

        seen = asyncio.run(main())
        worker.stop()
    assert seen == [(0, 0, {"holding": Occupancy(2, 2, 0)})] * ROUNDS  # before: 4 in 5 showed it in flight


class Watching:
    """An observer that notes what it is told (the server's metrics are one)."""

    def __init__(self):
        self.seen: list[tuple[str, str | None]] = []

    def first_segment(self, accepted):
        self.seen.append(("first_segment", None))

    def done(self, accepted, result):
        self.seen.append(("done", result.text))


def test_a_completion_nobody_reads_is_still_observed_once():
    """Found by the soak: a client that hung up just as its answer completed left the request counted
    completed but missing from the latency and token metrics, which the handler used to observe."""
    with Ensemble([ScriptedMember("a", factory=lambda m: ScriptedSession(list(WORDS), {}))]) as ensemble:
        worker = Worker(queue_size=4, max_concurrent=1)
        worker.observer = watching = Watching()
        worker.start(ensemble)

        async def submit_and_leave():
            j = job("nobody reads this")
            j.bind(asyncio.get_running_loop())
            worker.queue.submit(j)  # and never read its items: the client is gone
            for _ in range(200):
                if worker.queue.snapshot()["completed"]:
                    return
                await asyncio.sleep(0.02)

        asyncio.run(submit_and_leave())
        worker.stop()
    assert worker.queue.snapshot()["completed"] == 1
    assert watching.seen == [("first_segment", None), ("done", " one. two.")]


def test_a_crash_while_admitting_one_job_fails_that_job_and_the_worker_goes_on():
    """Without this, an exception that is not a SegfuseError (here from a member's tokenizer) ended
    the worker thread: every later request was accepted and never answered, while /health said ok."""

    class Odd(ScriptedMember):
        def prompt_tokens(self, messages):
            if "boom" in messages[-1].content:
                raise ValueError("a tokenizer bug")
            return [1, 2]

    with Ensemble([Odd("a", factory=lambda m: ScriptedSession(list(WORDS), {}))]) as ensemble:
        worker = Worker(queue_size=4, max_concurrent=1)
        worker.start(ensemble)
        crashed, fine = job("boom"), job("fine")
        results, _ = run_jobs(worker, [crashed, fine])
        worker.stop()
    assert isinstance(results[crashed.id][-1], Failed) and "tokenizer" in str(results[crashed.id][-1].error)
    assert isinstance(results[fine.id][-1], DoneEvent)
    assert worker.queue.snapshot()["failed"] == 1 and worker.queue.snapshot()["completed"] == 1


@pytest.mark.parametrize(
    ("streamed", "logprobs", "live"), [(True, False, True), (False, False, False), (True, True, False)]
)
def test_only_a_streamed_answer_hands_out_the_leaders_text_as_it_decodes(streamed, logprobs, live):
    """A whole answer goes out once: its tokens' events would only wake the handler's loop for nothing."""
    from segfuse.server.worker.jobs import flight_of

    job = Job(FusionRequest.of("hi", FusionOptions()), streamed=streamed, logprobs=logprobs)
    flight = flight_of(job, iter(()), lambda name: None, lambda tell: None, lambda *a: None)
    assert flight.live is live


def test_the_periodic_chore_runs_on_the_worker_thread_idle_or_busy_and_a_failure_stops_nothing():
    from segfuse.server.worker.periodic import Periodic

    ran: list[str] = []

    def chore():
        ran.append(threading.current_thread().name)
        if len(ran) == 1:
            raise RuntimeError("a disk that is full")  # logged; the worker goes on

    session = ScriptedSession(list(WORDS), {})
    with Ensemble([ScriptedMember("m", session)]) as ensemble:
        worker = Worker(queue_size=4, max_concurrent=1)
        worker.periodic = Periodic(0.05, chore, "a chore")
        worker.start(ensemble)
        for _ in range(100):  # idle: it wakes for the chore alone
            if len(ran) >= 3:
                break
            threading.Event().wait(0.05)
        results, _ = run_jobs(worker, [job("q")])
        worker.stop()
    assert len(ran) >= 3 and set(ran) == {"segfuse-worker"}
    (items,) = results.values()
    assert items[-1].result.text == " one. two."
    assert worker.fatal is None and worker.queue.snapshot()["worker_errors"] == 0
