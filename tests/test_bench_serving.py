"""The serving benchmark end to end, tiny: the real server in both modes, the real openai client."""

from __future__ import annotations

import json

import pytest

from segfuse.bench.serve import serving as bench_serve

pytestmark = [pytest.mark.models, pytest.mark.timeout(300)]


def test_bench_serve_measures_both_modes_and_writes_json(tmp_path):
    pytest.importorskip("openai")
    out = tmp_path / "bench-serve.json"
    lines: list[str] = []
    report = bench_serve.run([1, 2], requests=2, max_tokens=4, threads=1, out=out, log=lines.append)

    assert set(report["modes"]) == {"serial", "concurrent"}
    assert report["modes"]["serial"]["max_concurrent"] == 1
    assert report["modes"]["concurrent"]["max_concurrent"] == 2
    for mode in report["modes"].values():
        assert len(mode["members"]) == 3  # the embedded default three
        assert set(mode["levels"]) == {"1", "2"}
        for level, m in mode["levels"].items():
            assert m["requests"] == m["ok"] == 2 and m["errors"] == 0, m["error_messages"]
            assert m["concurrency"] == int(level)
            for key in ("requests_per_s", "output_tokens_per_s", "latency_p50_s", "latency_p95_s", "ttfs_p50_s"):
                assert m[key] is not None and m[key] > 0, key
            assert m["latency_p95_s"] >= m["latency_p50_s"]
            for o in m["outcomes"]:
                assert 0 < o["completion_tokens"] <= 4 and 0 < o["ttfs_s"] <= o["latency_s"]
        assert mode["server_counters"]["failed"] == 0
    for level in ("1", "2"):
        ratios = report["ratios"][level]
        for key in ("throughput", "requests_per_s", "p50_latency", "p50_ttfs"):
            assert ratios[key] is not None and ratios[key] > 0, key
    targets = report["targets"]
    assert targets["lone_latency_ratio"]["measured"] is not None  # concurrency 1 was measured
    assert targets["throughput_c4_ratio"]["met"] is None  # concurrency 4 was not
    assert report["settings"]["threads"] == 1 and report["machine"]["cores"]

    saved = json.loads(out.read_text())
    assert saved["ratios"] == json.loads(json.dumps(report["ratios"]))
    assert saved["modes"]["concurrent"]["levels"]["2"]["ok"] == 2
    # The printed tables have a row per mode and level, and one per target.
    assert len(bench_serve.format_table(report)) == 4 and len(bench_serve.format_targets(report)) == 3


def test_bench_chat_reuses_the_turns_and_the_shared_system_prompt(tmp_path):
    """Two chat turns and two users of the shared system prompt on all three systems: the cached
    server starts the second turn and the second user from what it read before, the others do not.

    The documents are cut to their opening paragraphs (about 170 prompt tokens instead of 1,000-1,200),
    so that every system reading every prompt takes a fraction of the timeout, on a loaded machine too."""
    pytest.importorskip("openai")
    pytest.importorskip("llama_cpp.server", reason="the anchor is llama-cpp-python's server")
    from segfuse.bench.chat import run as bench_chat
    from segfuse.bench.chat.script import MANUAL, POLICY, excerpt

    out = tmp_path / "bench-chat.json"
    report = bench_chat.run(
        reps=1, max_tokens=4, threads=1, turns=2, users=2, sections=0, out=out, log=lambda line: None
    )

    replies = report["replies"]
    assert not [r for r in replies if r["error"]], [r["error"] for r in replies if r["error"]]
    assert {r["system"] for r in replies} == set(bench_chat.SYSTEMS)
    assert all(r["ttfs_s"] and 0 < r["ttfs_s"] <= r["total_s"] for r in replies)
    rows = report["summary"]["systems"]["cache"]
    # the system prompts were sent (a token or more per word of the documents' opening), and no more
    assert len(excerpt(MANUAL, 0).split()) < rows["chat1"]["prompt_tokens"] < len(MANUAL.split())
    assert len(excerpt(POLICY, 0).split()) < rows["user1"]["prompt_tokens"] < len(POLICY.split())
    assert rows["chat2"]["prompt_tokens"] > rows["chat1"]["prompt_tokens"]  # the first answer is sent back
    leader = report["prefix_cache"]["cache"][bench_chat.LEADER]
    # the second turn reuses all of the first turn's prompt, the second user all of the shared system prompt
    # (the first user's prompt but for its question of some 25 tokens)
    assert leader["hits"] >= 2
    assert leader["reused_tokens"] > rows["chat1"]["prompt_tokens"] + rows["user1"]["prompt_tokens"] - 60
    assert report["prefix_cache"]["no-cache"][bench_chat.LEADER]["hits"] == 0
    assert all(value is not None for value in report["summary"]["ratios"].values())
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(report["summary"]))


def test_bench_followers_compares_the_default_with_eager_followers_and_the_leader(tmp_path):
    pytest.importorskip("openai")
    from segfuse.bench.followers import run as bench_followers

    report = bench_followers.run(
        [1], requests=2, max_tokens=4, threads=1, reps=1, out=tmp_path / "f.json", log=lambda line: None
    )
    systems = report["summary"]["systems"]
    assert set(systems) == {"lazy", "eager", "leader"}
    for system in systems.values():
        assert system["1"]["errors"] == 0 and system["1"]["tokens_per_s"] > 0
    assert report["summary"]["lone_latency_lazy_over_leader"] > 0


def test_bench_users_sets_the_servers_gain_beside_llama_cpps_own_batch(tmp_path):
    pytest.importorskip("openai")
    from segfuse.bench.serve.users import UsersPlan, run

    out = tmp_path / "bench-users.json"
    report = run(UsersPlan(users=2, tokens=4, reps=1, threads=1), out, log=lambda line: None)

    native = report["native"]
    assert native["threads"] == 1 and native["gain"] > 0
    assert len(native["lone_tokens_per_s"]) == len(native["batch_tokens_per_s"]) == 1
    levels = report["serve"]["levels"]
    assert set(levels) == {"off", "auto"}
    for mode in levels.values():
        for users, runs in mode.items():
            (level,) = runs
            requests = 2 if users == "1" else 4
            assert level["ok"] == requests and level["errors"] == 0, level["error_messages"]
            assert level["output_tokens"] == 4 * requests  # run to length: every answer is 4 tokens
    summary = report["summary"]
    assert summary["native_gain"] == native["gain"]
    for check in summary["checks"].values():
        assert check["measured"] is not None and check["measured"] > 0 and check["met"] in (True, False)
    assert json.loads(out.read_text())["summary"]["checks"].keys() == summary["checks"].keys()
