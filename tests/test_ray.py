"""Ray members (``ray:SPEC#replicas=K``) on a real two-node Ray cluster on loopback, with the real embedded
members: the answers are the local members' own, copies spread over the nodes, sessions on one copy are
batched (from one caller and from two), a copy killed mid-answer costs nothing but a re-read (or, with
no copy left, the member's place in the answer), a dead caller's session expires, and the cluster
leaves no process and made no connection off loopback (tests/ray_cluster.py).

One cluster serves the module (2 nodes x 2 CPUs); every copy runs one llama.cpp thread and asks Ray
for a quarter CPU, so that the copies of several tests fit at once. The last test shuts it down.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

pytest.importorskip("ray", reason="the ray extra is not installed: pip install '.[ray]'")

import ray

from helpers import wait_for
from ray_cluster import HEAD, WORKER, LoopbackCluster, is_loopback, is_wildcard, sockets
from segfuse import Ensemble
from segfuse.backends.ray.host import create_hosts
from segfuse.backends.ray.member import RayMember
from segfuse.backends.ray.settings import RaySettings
from segfuse.backends.registry import load_member
from segfuse.bench.ray.calls import median_ms
from segfuse.errors import InvalidRequestError
from segfuse.member_options import MemberOptions
from segfuse.models import DEFAULT_MODELS
from segfuse.types import Message, RoundEvent, Sampling, SegmentEvent

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

# Equal numbers on both sides: one thread, no prefix cache, the same window and slots.
OPTIONS = {"threads": 1, "prefix_cache_cells": 0, "n_ctx": 1024}
COPY = "cpus=0.25"  # what each copy asks Ray for: a quarter CPU (it runs one thread)
GREEDY = {"temperature": 0.0, "max_tokens": 20}
PROMPT = "Name three primary colors."
SMALL = "smollm2-135m"


@pytest.fixture(scope="module")
def cluster():
    running = LoopbackCluster().start()
    yield running
    running.stop()


def ray_member(spec: str, **options) -> RayMember:
    return load_member(f"ray:{spec}", **{**OPTIONS, **options})  # type: ignore[return-value]  # ray: loads one


@pytest.fixture(scope="module")
def ray_defaults(cluster):
    members = [ray_member(f"{name}#{COPY}") for name in DEFAULT_MODELS]
    yield members
    for member in members:
        member.close()


@pytest.fixture(scope="module")
def local_defaults():
    members = [load_member(name, **OPTIONS) for name in DEFAULT_MODELS]
    yield members
    for member in members:
        member.close()


def events(members, **options) -> list:
    """Every event of one generation; the members stay open (an Ensemble would close them)."""
    return list(Ensemble(members).stream(PROMPT, **GREEDY, **options))


# --- answers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"gate": None}, {}, {"gate": None, "prior": "prompt", "json_object": True}],
    ids=["plain", "default", "prompt-fit-json"],
)
def test_greedy_answers_equal_the_same_members_loaded_locally(ray_defaults, local_defaults, options):
    remote, local = events(ray_defaults, **options), events(local_defaults, **options)
    answer, expected = remote[-1].result, local[-1].result
    assert answer.text.strip() and answer.text == expected.text
    assert answer.prompt_bpb == expected.prompt_bpb and answer.valid == expected.valid  # prompt fit, the constraint
    if "prior" in options:
        assert len(answer.prompt_bpb) == 3 and answer.text.startswith("{")
    assert [s.model for s in answer.segments] == [s.model for s in expected.segments]
    assert answer.stats.finish_reason == expected.stats.finish_reason and not answer.departures
    if not options:  # the leader answers alone: its text went out as the copy sampled it, as locally
        partial = [e.segment.text for e in remote if isinstance(e, SegmentEvent) and e.partial]
        assert partial and partial == [e.segment.text for e in local if isinstance(e, SegmentEvent) and e.partial]
    for member in [*ray_defaults, *local_defaults]:
        prefix = member.occupancy().prefix
        assert prefix is not None and prefix.hits == 0 and prefix.bound == 0
    assert all(m.capabilities.parallel_safe and m.capabilities.batched for m in ray_defaults)


def test_the_members_own_calls_equal_the_local_members(ray_defaults, local_defaults):
    """Echo, tokens and the templated prompt, answered by a copy, are the local member's."""
    text, messages = "The sky is blue because", [Message("user", PROMPT)]
    for remote, local in zip(ray_defaults, local_defaults):
        ids = local.tokenize_text(text)
        assert remote.tokenize_text(text) == ids and remote.detokenize(ids) == local.detokenize(ids) == text
        assert remote.lead_tokens() == local.lead_tokens()
        assert remote.prompt_tokens(messages) == local.prompt_tokens(messages)
        assert remote.echo(text, top_k=2) == local.echo(text, top_k=2)
        assert remote.n_params == local.n_params and remote.name == local.name


def test_copies_spread_over_both_nodes(cluster):
    member = ray_member(f"{SMALL}#replicas=2,{COPY}")
    try:
        member.refresh()
        rows = member.view()
        assert {row["node_ip"] for row in rows} == {HEAD, WORKER}
        assert len({row["node_id"] for row in rows}) == 2 and all(row["up"] for row in rows)
        assert HEAD in member.placement and WORKER in member.placement
        held = member.occupancy()
        assert (held.slots, held.free_slots) == (2, 2)
    finally:
        member.close()


def copy_processes() -> set[int]:
    """Copies' processes in this test's cluster (each copy is a Ray worker process named after its class)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if _name(p) == "ray::MemberHost"}


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:  # it ended meanwhile
        return ""


def test_a_copy_that_cannot_load_its_member_says_why_and_none_is_left(cluster):
    before = copy_processes()  # other tests' copies (some may be ending)
    with pytest.raises(InvalidRequestError, match="member option 'bogus'"):
        ray_member(f"{SMALL}#replicas=2,bogus=1,{COPY}")
    wait_for(lambda: not copy_processes() - before, 60, 0.5, "the copies to be killed")


# --- batching --------------------------------------------------------------------------------------


def host_stats(member: RayMember) -> dict[str, int]:
    member.refresh()
    return member.view()[0]["stats"]


def test_concurrent_sessions_of_one_caller_are_batched_on_their_copy(cluster):
    member = ray_member(f"{SMALL}#{COPY}", slots=4)
    try:
        prompts = [PROMPT, "Say hello.", "Count to five.", "Name a fruit."]
        results = Ensemble([member]).generate_many(prompts, max_concurrent=4, gate=None, **GREEDY)
        assert all(r.text.strip() for r in results)
        stats = host_stats(member)
        assert stats["draft_batches"] < stats["draft_calls"], stats
        assert stats["draft_decodes"] < stats["draft_decodes_apart"]  # one decode per token for them all
        assert member.occupancy().free_slots == 4
    finally:
        member.close()


def test_two_callers_sessions_are_batched_on_one_copy(cluster):
    """Two front ends (two RayMembers over the same copy, each in its own thread) answer at once: the
    copy serves their drafts together, waiting a little for the other's next call (gather_ms)."""
    settings = RaySettings(gather_ms=50)
    hosts = create_hosts(SMALL, MemberOptions.build({**OPTIONS, "slots": 2}), RaySettings(cpus=0.25, gather_ms=50))
    callers = [RayMember(hosts, settings), RayMember(hosts, settings)]
    try:
        results: list = [None, None]

        def answer(k: int) -> None:
            results[k] = Ensemble([callers[k]]).generate(["Say hello.", PROMPT][k], gate=None, **GREEDY)

        threads = [threading.Thread(target=answer, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r is not None and r.text.strip() for r in results)
        stats = host_stats(callers[0])
        assert stats["gathered"] > 0 and stats["draft_batches"] < stats["draft_calls"], stats
    finally:
        for handle in hosts:
            ray.kill(handle, no_restart=True)


def test_a_conversations_next_turn_goes_to_the_copy_that_read_it(cluster):
    """With two copies, a chat's next turn goes where its last turn was read, and reads that from the copy's
    prefix cache, even while that copy holds more sessions than the other (it has a free slot)."""
    member = ray_member(f"{SMALL}#replicas=2,{COPY}", prefix_cache_cells=None, slots=2)
    try:
        ensemble = Ensemble([member])
        chat = [Message("system", "You are a terse assistant. " * 20), Message("user", PROMPT)]
        first = ensemble.generate(chat, gate=None, **GREEDY)
        member.refresh()
        here = next(row["copy"] for row in member.view() if row["stats"].get("draft_calls"))
        before = {row["copy"]: row["prefix_hits"] for row in member.view()}
        holder = member.start(chat, seed=0, reserve=16)  # the same prompt again, held open: more load there
        assert holder.copy.index == here
        second = ensemble.generate(
            [*chat, Message("assistant", first.text), Message("user", "And three more?")], gate=None, **GREEDY
        )
        holder.close()
        assert second.text.strip() and second.counters[SMALL]["reused"] > 0
        member.refresh()
        after = {row["copy"]: row["prefix_hits"] for row in member.view()}
        assert after == {here: before[here] + 2, 1 - here: before[1 - here]}
    finally:
        member.close()


# --- faults ----------------------------------------------------------------------------------------


def busy_copy(member: RayMember):
    member.refresh()
    return next(c for c in member.copies.all if c.load > 0)


def test_a_copy_killed_between_rounds_the_session_is_read_again_on_the_other(cluster):
    member = ray_member(f"{SMALL}#replicas=2,{COPY}")
    try:
        killed = []
        for event in Ensemble([member]).stream(PROMPT, gate=None, **GREEDY):
            if isinstance(event, RoundEvent) and not killed:
                killed.append(busy_copy(member))
                ray.kill(killed[0].handle, no_restart=False)  # Ray restarts it, without its sessions
        result = event.result
        assert result.text.strip() and not result.departures and result.stats.finish_reason in ("stop", "length")
        assert member.stats["reread"] == 1
        copy = killed[0]
        old_pid = copy.info.pid
        wait_for(
            lambda: member.refresh() or (copy.up and copy.info.pid != old_pid),
            120,
            0.5,
            "the killed copy to be restarted",
        )
    finally:
        member.close()


def test_a_copy_killed_while_a_generation_runs_the_answer_completes(cluster):
    member = ray_member(f"{SMALL}#replicas=2,{COPY}")
    try:
        started = threading.Event()

        def kill() -> None:
            started.wait(120)
            time.sleep(0.05)  # mid-call, or between two: either way unseen by the engine
            ray.kill(busy_copy(member).handle, no_restart=False)

        killer = threading.Thread(target=kill)
        killer.start()
        result = None
        for event in Ensemble([member]).stream(PROMPT, gate=None, window=4, **GREEDY):
            if isinstance(event, RoundEvent):
                started.set()
            result = getattr(event, "result", result)
        killer.join()
        assert result.text.strip() and not result.departures
        assert member.stats["reread"] >= 1
    finally:
        member.close()


def test_the_only_copy_killed_while_it_drafts_the_engine_fails_over(cluster):
    """The leader's only copy is killed while its text streams: no copy is left (and its draft went out in
    part), so the call raises and the next member takes over from the answer so far."""
    leader = ray_member(f"{SMALL}#{COPY}")
    follower = load_member("gemma3-270m", **OPTIONS)
    try:
        streamed, result = [], None
        for event in Ensemble([leader, follower]).stream(PROMPT, leader=SMALL, **{**GREEDY, "max_tokens": 32}):
            if isinstance(event, SegmentEvent) and event.partial and not streamed:
                streamed.append(event.segment.text)
                ray.kill(leader.hosts[0], no_restart=True)
            result = getattr(event, "result", result)
        assert streamed and result.text.startswith(streamed[0])
        assert [(d.model, d.kind) for d in result.departures] == [(SMALL, "fault")]
        assert any(s.model == "gemma3-270m" for s in result.segments)
    finally:
        leader.close()
        follower.close()


def test_calls_cancelled_mid_draft_and_while_waiting_leave_the_copy_serving(cluster):
    """A streaming draft cancelled after its first text, and a call cancelled while it waits behind it: the
    copy's thread finishes the one, drops the other, and serves both sessions on."""
    member = ray_member(f"{SMALL}#{COPY}", slots=2)
    try:
        first, second = (member.start([Message("user", p)], seed=0, reserve=16) for p in (PROMPT, "Say hello."))
        handle, greedy = first.copy.handle, Sampling(0.0, 1.0, 0)
        drafting = handle.draft.options(num_returns="streaming").remote(
            [(first.sid, 300, Sampling(0.0, 1.0, 0, ignore_eos=True), True)]
        )
        assert isinstance(ray.get(next(drafting)), tuple)  # (item, text so far): it is drafting
        waiting = handle.session.remote(second.sid, "accept", (" Hello",))
        wait_for(lambda: member.refresh() or member.view()[0]["waiting"], 60, 0.05, "the accept to wait its turn")
        ray.cancel(waiting)
        ray.cancel(drafting)
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(waiting, timeout=60)
        first.accept("")  # drop the long draft's tokens
        assert first.draft(4, greedy).pieces and second.draft(4, greedy).pieces
        stats = host_stats(member)
        assert stats["dropped"] == 1 and stats["draft_tokens"] >= 300, stats
    finally:
        member.close()


EXPIRING = "segfuse-test-expiry"


def test_a_caller_killed_mid_draft_leaves_the_copy_free_and_its_session_expires(cluster):
    """A front-end process opens a session on a copy and is killed while its draft streams: the copy finishes
    the draft (its thread never waits for a caller), serves the next caller, and closes the dead caller's
    session once no call touched it for expire_s, which frees its slot."""
    settings = RaySettings(cpus=0.25, expire_s=2)
    hosts = create_hosts(
        SMALL, MemberOptions.build({**OPTIONS, "slots": 2}), settings, name=EXPIRING, namespace=EXPIRING
    )
    member = RayMember(hosts, settings, owned=True)
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys
        import ray
        from segfuse.backends.ray.member import RayMember
        from segfuse.types import Message, Sampling
        ray.init(address={cluster.address!r}, namespace={EXPIRING!r}, _node_ip_address={HEAD!r})
        member = RayMember([ray.get_actor({EXPIRING + "-0"!r})])
        session = member.start([Message("user", "Tell a long story.")], seed=0, reserve=16)
        told = []

        def on_text(text):
            if not told:
                told.append(text)
                print("drafting", flush=True)
                sys.stdin.readline()  # killed while it waits here, its draft still running on the copy

        session.draft(400, Sampling(0.0, 1.0, 0, ignore_eos=True), on_text)
    """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert caller.stdout.readline().strip() == "drafting"
        caller.send_signal(signal.SIGKILL)
        caller.wait(30)
        assert Ensemble([member]).generate(PROMPT, gate=None, **GREEDY).text.strip()  # the copy serves others
        wait_for(lambda: member.occupancy().free_slots == 2, 60, 0.5, "the dead caller's session to expire")
        stats = host_stats(member)
        assert stats["expired"] == 1 and stats["draft_tokens"] > 400, stats
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait(30)
        member.close()


# --- cost ------------------------------------------------------------------------------------------


CANDIDATES = [" Red", " Blue, green", " The", ""]


def costs(member) -> tuple[float, float, object, object]:
    """Median ms of a 1-token greedy draft and of a score of 4 candidates on one session (each dropped
    after, so that every call starts from the same context); then one more draft and score, their values."""
    session = member.start([Message("user", PROMPT)], seed=0, reserve=16)
    greedy = Sampling(0.0, 1.0, 0)
    try:

        def drop() -> None:
            session.accept("")

        return (
            median_ms(lambda: session.draft(1, greedy), drop, 50),
            median_ms(lambda: session.score(CANDIDATES), drop, 50),
            session.draft(1, greedy),
            session.score(CANDIDATES),
        )
    finally:
        session.close()


def test_what_one_call_costs_against_a_local_member(cluster, capsys):
    """A 1-token draft and a score of 4 candidates, 50 of each, on a Ray member and on the same member
    loaded here: the numbers are the same, and the medians are printed (docs/deploy.md quotes them)."""
    remote, local = ray_member(f"{SMALL}#{COPY}"), load_member(SMALL, **OPTIONS)
    try:
        figures = {"ray": costs(remote), "local": costs(local)}
        assert figures["ray"][2:] == figures["local"][2:]
        with capsys.disabled():
            for name, (d, s, _, _) in figures.items():
                print(f"\n{name}: 1-token draft {d:.2f} ms, score of 4 candidates {s:.2f} ms (median of 50)")
    finally:
        remote.close()
        local.close()


# --- the cluster ends ------------------------------------------------------------------------------


def test_the_cluster_leaves_no_process_and_spoke_only_on_loopback(cluster):
    """Runs last: the nodes are on loopback, every connection of every Ray process went to a loopback
    address (Ray's servers listen on loopback or the wildcard address), and once the cluster is shut
    down (by its handles, never `ray stop`) none of its processes is left."""
    member = ray_member(f"{SMALL}#{COPY}")
    try:
        assert Ensemble([member]).generate(PROMPT, **GREEDY).text.strip()
        assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {HEAD, WORKER}
        listening, remote = sockets(cluster.note())
        assert remote and all(is_loopback(ip) for ip in remote), remote
        assert all(is_loopback(ip) or is_wildcard(ip) for ip in listening), listening
    finally:
        member.close()
    noted = cluster.note()
    assert any("raylet" in p.name() for p in noted) and any("gcs_server" in p.name() for p in noted)
    left = cluster.stop()
    assert not left, [(p.pid, p.name()) for p in left]
    assert not ray.is_initialized()
