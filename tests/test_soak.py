"""The soak (`segfuse bench soak`): its pure parts, then a short run on the real server.

The pure parts need no models: durations, the seeded traffic mix, the accounting that sets the
client's outcomes against the server's counters, latency tenths, memory growth, targets. The last
test soaks a real `segfuse serve` with the default members for about 40 s of traffic and checks
the accounting and the idle state; it never checks timings (the machine may be busy).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import replace
from itertools import islice
from typing import Any

import pytest

from segfuse.bench.soak import accounting as acc
from segfuse.bench.soak.accounting import Memory, Record
from segfuse.bench.soak.duration import format_duration, parse_duration
from segfuse.bench.soak.run import held
from segfuse.bench.soak.traffic import (
    HOSTILE,
    KINDS,
    LEVELS,
    MALFORMED,
    MIXED,
    TEXT_PATH,
    TOKENS_PER_WORD,
    Mix,
    backtracking_schema,
    filler,
    malformed_body,
    messages,
    nested_schema,
    plan,
    probe,
)
from segfuse.errors import SegfuseError

# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    "text, seconds",
    [("30m", 1800), ("90s", 90), ("1h30m", 5400), ("2.5m", 150), ("45", 45), ("1h 5m 3s", 3903), (" 10S ", 10)],
)
def test_durations_are_read_as_people_write_them(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "30x", "5m1h", "1m1m", "10s5", "-3s", "0s", "1.m", "1h30"])
def test_a_duration_that_is_not_one_is_refused_with_an_example(text):
    with pytest.raises(SegfuseError, match="duration") as error:
        parse_duration(text)
    assert "30m" in error.value.hint


def test_durations_are_written_back_the_same_way():
    written = [format_duration(s) for s in (1800, 90, 3903, 3600, 45.4, 0)]
    assert written == ["30m", "1m30s", "1h5m3s", "1h", "45s", "0s"]


# --------------------------------------------------------------------------- the traffic mix


def phases(seed: int, n: int, **mix):
    return list(islice(plan(Mix(seed=seed, **mix)), n))


def test_the_same_seed_gives_the_same_traffic_and_another_seed_other_traffic():
    assert phases(7, 12) == phases(7, 12)
    assert phases(7, 12) != phases(8, 12)


def test_every_cycle_runs_each_level_once_then_a_burst_and_holds_every_kind():
    run = phases(3, 15, max_tokens=16, burst=13)
    for k in range(3):
        cycle = run[5 * k : 5 * k + 5]
        assert {p.cycle for p in cycle} == {k}
        assert sorted(p.concurrency for p in cycle[:4]) == sorted(LEVELS) and cycle[4].kind == "burst"
        assert cycle[4].concurrency == len(cycle[4].actions) == 13
        assert {a.kind for p in cycle[:4] for a in p.actions} == set(MIXED)
        for p in cycle[:4]:
            assert len(p.actions) == max(3, 2 * p.concurrency) and p.kind == "mixed"
    actions = [a for p in run for a in p.actions]
    assert len({a.index for a in actions}) == len(actions)  # one id per request


def test_each_action_carries_only_what_its_kind_needs():
    actions = [a for p in phases(1, 30, max_tokens=16) for a in p.actions]
    for a in actions:
        assert 8 <= a.max_tokens <= 16 and a.temperature in (0.0, 0.6)
        assert (a.timeout_s is not None) == (a.kind == "timeout")
        assert (a.fill is not None) == (a.kind in ("near_limit", "over_limit"))
        if a.kind == "timeout":
            assert 1.0 <= a.timeout_s <= 4.0
        if a.kind == "near_limit":
            assert 0.6 <= a.fill <= 0.95
        if a.kind == "over_limit":
            assert 1.2 <= a.fill <= 2.0
        if a.kind == "malformed":
            assert 0 <= a.prompt < len(MALFORMED)
        if a.kind == "hostile":
            assert 0 <= a.prompt < len(HOSTILE)
    assert set(KINDS["drop_first"].expected) == {"abandoned"} and "rejected" in KINDS["burst"].expected


def test_malformed_and_hostile_requests_are_sent_in_turn_so_a_short_run_sends_them_all():
    actions = [a for p in phases(5, 60) for a in p.actions]
    for kind, cases in (("malformed", MALFORMED), ("hostile", HOSTILE)):
        sent = [a.prompt for a in actions if a.kind == kind][: len(cases)]
        assert len(sent) == len(cases) and sorted(sent) == list(range(len(cases))), kind


def test_prompts_near_and_over_the_window_are_about_the_asked_size():
    for tokens in (100, 400, 1000):
        assert abs(len(filler(tokens).split()) * TOKENS_PER_WORD - tokens) <= 2 * TOKENS_PER_WORD
    near = next(a for p in phases(0, 30) for a in p.actions if a.kind == "near_limit")
    text = messages(near, 512)[-1]["content"]
    assert abs(len(text.split()) * TOKENS_PER_WORD - near.fill * 512) < 30  # the question adds a few words
    turns = messages(next(a for p in phases(0, 30) for a in p.actions if a.kind == "multi_turn"), 512)
    assert [m["role"] for m in turns] == ["system", "user", "assistant", "user"]
    assert messages(probe(99, Mix()), 512) == messages(probe(5, Mix(seed=9)), 512)  # always the same probe


def test_malformed_bodies():
    big = next(m for m in MALFORMED if m.oversized)
    assert len(malformed_body(big, 1000)) > 1000 and json.loads(malformed_body(big, 1000))
    assert malformed_body(next(m for m in MALFORMED if m.method == "GET"), 1000) is None
    tools = next(m for m in MALFORMED if m.name == "a tool without a name")
    assert json.loads(malformed_body(tools, 1000))["tools"]
    assert all(400 <= m.status < 500 for m in MALFORMED)
    assert len({m.name for m in MALFORMED}) == len(MALFORMED)


def server_refusal(body: bytes, path: str) -> tuple[int, str | None, str | None] | None:
    """What the server's own request parsing says of a body, before any member: (status, code, param) of
    its refusal, or None where it would go on to the members."""
    from segfuse.options import FusionOptions
    from segfuse.server import parsing
    from segfuse.server.chat import planning
    from segfuse.server.completions.serving import COMPLETIONS, requests_of
    from segfuse.server.serving import APIError

    try:
        if path == TEXT_PATH:
            parsed = parsing.parse_request(body, COMPLETIONS)
            requests_of(parsed, [p if isinstance(p, str) else "ids" for p in parsed.prompts], FusionOptions())
            return None
        request = parsing.parse_request(body, planning.CHAT)
        tools, mode = planning.offered_tools(request)
        planning.top_logprobs(request)
        planning.constraint_of(request, tools, mode)
        planning.to_engine_messages(request, tools, mode)
        parsing.fusion_options(request, FusionOptions())
    except APIError as exc:
        return exc.status, exc.detail.code, exc.detail.param
    return None


def test_the_malformed_traffic_follows_the_servers_contract():
    """Each malformed request the server's parsing decides on is refused there, as the soak expects: a
    parameter counts as malformed only if the server refuses it (logprobs, once refused, is served now)."""
    decided_by_parsing = [
        m
        for m in MALFORMED
        if m.key and m.method == "POST" and not m.oversized and m.code not in ("model_not_found", "not_found")
    ]
    assert len(decided_by_parsing) >= 10
    for m in decided_by_parsing:
        status, code, param = server_refusal(malformed_body(m, 65536), m.path) or (200, None, None)
        assert (status, code) == (m.status, m.code), m.name
        assert m.param is None or param == m.param, m.name
    refused = {m.param for m in MALFORMED if m.code == "unsupported_parameter"}
    assert len(refused) >= 3 and "logprobs" not in refused
    say_hi = [{"role": "user", "content": "Say hi."}]
    assert server_refusal(json.dumps({"messages": say_hi, "logprobs": True}).encode(), "/v1/chat/completions") is None


def test_hostile_requests():
    assert len({h.name for h in HOSTILE}) == len(HOSTILE)
    for h in HOSTILE:
        assert h.outcomes and h.outcomes <= {"answered", "refused", "invalid"}, h.name
        assert len(h.body()) < 65536 and all(400 <= s < 500 for s in h.statuses), h.name
    assert json.dumps(nested_schema(100)).count('"properties"') == 100
    assert backtracking_schema(3)["required"] == ["aaa!"]
    # The ones the server's parsing must refuse by itself (the rest need the live server: tests/test_hostile.py).
    by_name = {h.name: h for h in HOSTILE}
    for name in ("a malformed earlier tool call (1)", "a schema nested 100 levels"):
        h = by_name[name]
        status, _, _ = server_refusal(h.body(), h.path) or (200, None, None)
        assert status in h.statuses, name


# --------------------------------------------------------------------------- accounting


def rec(
    index: int, kind: str, outcome: str, *, cycle: int = 0, start: float = 0.0, latency: float = 1.0, **more: Any
) -> Record:
    """A record of phase 0 as the client writes it; `more`: its other fields (an answered one has an id)."""
    more.setdefault("response_id", f"id{index}" if outcome == "answered" else None)
    return Record(index, kind, 0, cycle, start, latency, outcome, tuple(sorted(KINDS[kind].expected)), **more)


RECORDS = [
    rec(0, "stream", "answered", finishes=1),
    rec(1, "complete", "answered"),
    rec(2, "drop_first", "abandoned"),
    rec(3, "timeout", "abandoned"),
    rec(4, "burst", "rejected"),
    rec(5, "over_limit", "invalid"),
    rec(6, "malformed", "refused"),
]
# The server's side of RECORDS: one abandoned request finished before its client left, one was cancelled.
COUNTERS = {"accepted": 5, "rejected": 1, "started": 5, "completed": 3, "cancelled": 1, "invalid": 1, "failed": 0}
METRICS = {
    acc.metric_key("segfuse_requests_total", {"outcome": o}): COUNTERS[o]
    for o in ("completed", "cancelled", "invalid", "failed", "rejected")
}
METRICS |= {"segfuse_requests_accepted_total": 5, "segfuse_request_latency_seconds_count": 3}
IDLE = {"waiting": 0, "running": 0}


def failing(checks):
    return [c.name for c in checks if not c.ok]


def test_consistent_counts_pass_every_check():
    assert failing(acc.reconcile(RECORDS, COUNTERS, METRICS, IDLE)) == []
    assert acc.tally(RECORDS)["abandoned"] == 2 and acc.by_kind(RECORDS)["burst"]["rejected"] == 1


def test_a_request_counted_twice_or_never_is_caught():
    twice = COUNTERS | {"cancelled": 2}  # a cancel counted twice: more ends than acceptances
    assert "every accepted request ended once" in failing(acc.reconcile(RECORDS, twice, METRICS, IDLE))
    stuck = {"waiting": 1, "running": 0}  # a request left in the queue
    assert "every accepted request ended once" in failing(acc.reconcile(RECORDS, COUNTERS, METRICS, stuck))
    lost = [*RECORDS, rec(7, "stream", "lost")]
    assert "no request lost by the client" in failing(acc.reconcile(lost, COUNTERS, METRICS, IDLE))
    unseen = COUNTERS | {"accepted": 4, "completed": 2}  # the server never saw an answered request
    assert "accepted = requests that reached the worker" in failing(acc.reconcile(RECORDS, unseen, METRICS, IDLE))


def test_duplicated_answers_and_empty_200s_are_caught():
    dupe = [*RECORDS[:-1], rec(9, "stream", "answered", response_id="id0", finishes=2)]
    found = acc.duplicates(dupe)
    assert any("id0" in f for f in found) and any("2 finish chunks" in f for f in found)
    assert "no duplicated answer" in failing(acc.reconcile(dupe, COUNTERS, METRICS, IDLE))
    empty = [replace(RECORDS[0], outcome="empty"), *RECORDS[1:]]
    assert failing(acc.reconcile(empty, COUNTERS, METRICS, IDLE)) == ["no empty 200"]


def test_a_wrong_answer_for_its_kind_is_caught():
    wrong = [*RECORDS[:-1], replace(RECORDS[-1], outcome="unexpected", status=500)]
    assert failing(acc.reconcile(wrong, COUNTERS, METRICS, IDLE)) == ["every request got the answer its kind expects"]


def test_metrics_that_disagree_with_health_are_caught():
    unobserved = METRICS | {"segfuse_request_latency_seconds_count": 2}  # a completion not observed
    assert failing(acc.agree(COUNTERS, unobserved)) == ["/metrics latency observations = completed"]
    text = (
        '# TYPE segfuse_requests counter\nsegfuse_requests_total{outcome="completed"} 3.0\n'
        "# TYPE segfuse_rounds counter\nsegfuse_rounds_total 7.0\n"
    )
    assert acc.parse_metrics(text) == {"segfuse_requests_total{outcome=completed}": 3.0, "segfuse_rounds_total": 7.0}
    assert acc.delta({"a": 1, "b": 2}, {"a": 4, "b": 2, "c": 1}) == {"a": 3, "b": 0, "c": 1}


def test_latency_drift_compares_whole_cycles():
    def cycle(k: int, latency: float) -> list[Record]:
        normal = [
            rec(10 * k + i, "stream", "answered", cycle=k, start=100.0 * k + i, latency=latency) for i in range(4)
        ]
        return [*normal, rec(10 * k + 9, "burst", "answered", cycle=k, start=100.0 * k + 9, latency=50.0)]

    assert acc.latency_tenths(cycle(0, 1.0), acc_kinds())["p95_ratio"] is None  # one cycle: nothing to compare
    records = [r for k in range(20) for r in cycle(k, 1.0 if k < 18 else 1.5)]
    records += [rec(999, "stream", "answered", cycle=20, start=2001.0, latency=99.0)]  # cycle 21 never finished
    tenths = acc.latency_tenths(records, acc_kinds())
    assert tenths["cycles"] == 20 and tenths["first"]["cycles"] == [0, 1] and tenths["last"]["cycles"] == [18, 19]
    assert tenths["first"]["requests"] == 8 and tenths["p95_ratio"] == pytest.approx(1.5)  # bursts left out


def acc_kinds():
    return frozenset({"stream", "complete", "multi_turn"})


def test_memory_growth_after_warm_up_and_per_thousand_requests():
    memory = Memory(start_mb=900.0, warm_mb=1000.0, end_mb=1030.0, requests_since_warm=600)
    assert memory.growth == pytest.approx(0.03) and memory.per_1000_mb == pytest.approx(50.0)
    assert Memory(900.0, None, 1000.0, 0).growth is None and Memory(900.0, 1000.0, 1000.0, 0).per_1000_mb is None


def test_targets_are_measured_and_judged_never_enforced():
    memory = Memory(900.0, 1000.0, 1080.0, 500)
    t = acc.targets([*RECORDS, rec(8, "stream", "lost")], memory, held_when_idle=0, p95_ratio=None)
    assert t["lost_or_duplicated"]["measured"] == 1 and t["lost_or_duplicated"]["met"] is False
    assert t["memory_growth"]["met"] is False and t["held_when_idle"]["met"] is True
    assert t["p95_drift"]["met"] is None  # not measured


def test_held_names_members_holding_slots_or_cells_and_ignores_those_that_cannot_tell():
    health = {
        "occupancy": {
            "a": {"slots": 4, "free_slots": 3, "cache_cells": 120},
            "b": {"slots": 4, "free_slots": 4, "cache_cells": 0},
            "remote": {"slots": None, "free_slots": None, "cache_cells": None},
        }
    }
    assert held(health) == ["a: 1 slots", "a: 120 cells"]
    assert held({"occupancy": {}}) == []


# --------------------------------------------------------------------------- a short soak on the real server


@pytest.mark.models
@pytest.mark.timeout(600)
def test_a_short_soak_loses_nothing_and_leaves_the_server_idle_and_clean(tmp_path):
    pytest.importorskip("openai")
    from rich.console import Console

    from segfuse.bench.soak import report as soak_report
    from segfuse.bench.soak import run as soak

    settings = soak.SoakSettings(duration_s=40, seed=0, max_tokens=4, threads=1)
    report = soak.run(settings, out=tmp_path / "soak.json", log=lambda line: None)

    failed = [c for c in report["checks"] if not c["ok"]]
    assert not failed, failed
    outcomes = report["outcomes"]
    assert outcomes["lost"] == outcomes["empty"] == outcomes["unexpected"] == 0
    assert outcomes["answered"] and outcomes["abandoned"] and outcomes["refused"] and outcomes["invalid"]
    assert report["by_kind"]["hostile"]["refused"] and report["by_kind"]["malformed"]["refused"]
    assert report["counters_delta"]["accepted"] == sum(outcomes[o] for o in acc.REACHED)
    for checkpoint in report["checkpoints"]:  # idle: queue empty, every slot free, no KV cell held
        assert (checkpoint["waiting"], checkpoint["running"], checkpoint["held"]) == (0, 0, []), checkpoint
        for member in checkpoint["occupancy"].values():
            assert member["free_slots"] == member["slots"] == 4 and member["cache_cells"] == 0
    assert report["memory"]["start_mb"] > 0 and report["memory"]["end_mb"] > 0
    assert report["log_errors"]["count"] == 0, report["log_errors"]["first"]

    saved = json.loads((tmp_path / "soak.json").read_text())
    assert saved["outcomes"] == outcomes and len(saved["records"]) == report["requests"]
    assert (tmp_path / "soak.server.log").exists()
    console = Console(file=io.StringIO(), width=200)
    soak_report.print_report(report, console)
    assert "accounting: all" in console.file.getvalue()
    pytest.importorskip("matplotlib")
    assert soak_report.plot(report, tmp_path / "soak.png").stat().st_size > 10_000


# --------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "args, says",
    [
        (["--serve", "--soak", "1m", "--threads", "1"], "use `segfuse bench soak 1m --threads 1`"),
        (["soak", "1x"], "not a duration"),
        (["soak", "1m", "--replicas", "2"], "add --ray"),
        (["soak", "1m", "--remote", "-m", "smollm2-135m"], "leave out -m"),
    ],
)
@pytest.mark.slow
def test_soak_options_are_checked_before_anything_starts(args, says):
    done = subprocess.run(
        [sys.executable, "-m", "segfuse.cli", "bench", *args], input="", capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_soak_out_may_name_a_folder_or_a_file(tmp_path):
    # A folder (as `bench --out` takes for the other benches) gets soak.json inside it; it used to crash when the
    # run wrote its report, after the whole soak.
    from segfuse.cli.bench_serving import soak_path

    assert soak_path(str(tmp_path)) == tmp_path / "soak.json"
    assert soak_path(str(tmp_path / "new") + "/") == tmp_path / "new" / "soak.json"
    assert (tmp_path / "new").is_dir()
    assert soak_path(str(tmp_path / "deep" / "run.json")) == tmp_path / "deep" / "run.json"
    assert (tmp_path / "deep").is_dir()


def test_the_log_check_reads_past_rays_line_prefixes(tmp_path):
    """On Ray, a replica's lines reach the server's log behind a coloured "(ServeReplica:... pid=N) "."""
    from segfuse.bench.soak.run import log_errors

    log = tmp_path / "server.log"
    log.write_text(
        "\x1b[36m(ServeReplica:segfuse:Front pid=25398)\x1b[0m INFO a request\n"
        "\x1b[36m(ServeReplica:segfuse:Front pid=25398)\x1b[0m Traceback (most recent call last):\n"
        "\x1b[36m(ServeReplica:segfuse:Front pid=25398, ip=127.0.0.3)\x1b[0m Traceback (most recent call last):\n"
        "plain line\n"
    )
    found = log_errors(log)
    assert found["count"] == 2
    assert found["first"][0].startswith("Traceback")
