"""`segfuse bench` (the speed benchmark) for any members: its summary and tables, its plan's choices and flags
(pure logic), and a real run over a transformers member beside a llama.cpp one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from segfuse.bench.speed.plan import Plan, check_reference, settle
from segfuse.bench.speed.speeds import floor_seconds
from segfuse.bench.speed.systems import DEFAULT, PLAIN
from segfuse.bench.speed.table import summary, tables
from segfuse.bench.speed.users import user_prompts
from segfuse.errors import SegfuseError


def test_the_summary_gives_a_ratio_only_where_both_of_its_rows_are():
    rows = {"fusion": [4.0, 2.0, 3.0], "fusion_tokens": [12, 12, 12], "floor": [2.0, 2.0, 2.0], "default": [1.0]}
    entry = summary(rows)
    assert entry["fusion"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3}
    assert entry["ratio_vs_floor"] == 1.5 and entry["fusion_tokens_per_s"] == 4.0
    assert "default_over_leader_alone" not in entry  # no leader_alone row
    assert "ratio_reference_over_fusion" not in entry  # the reference method was left out


def test_each_system_gets_a_table_and_a_column_only_for_rows_some_length_has():
    full = summary(
        {
            "fusion": [3.0],
            "fusion_ttfs": [0.5],
            "fusion_tokens": [12],
            "floor": [2.0],
            "members_sum": [2.5],
            "default": [1.0],
            "default_ttfs": [0.2],
            "default_tokens": [12],
            "leader_alone": [0.9],
            "leader_generate": [0.8],
            "fusion_one_by_one": [8.0],
            "fusion_at_once": [4.0],
            "default_one_by_one": [3.0],
            "default_at_once": [2.0],
        }
    )
    lean = {k: v for k, v in full.items() if not k.startswith("leader_generate") and "generate" not in k}
    printed = tables({"users": 2, "lengths": {"12": full, "24": lean}})
    assert [system for system, _, _ in printed] == [PLAIN, DEFAULT]
    _, plain_header, plain_rows = printed[0]
    assert "reference" not in plain_header and "RSS ratio" not in plain_header
    assert plain_rows[0][plain_header.index("throughput ×")] == "2.00"
    _, header, rows = printed[1]
    assert "default / generate" in header and "2 at once" in header
    at = header.index("default / generate")
    assert rows[0][at] == "1.25" and rows[1][at] == "–"  # the length without the baseline shows a dash


def test_the_floor_prices_every_started_member_at_its_own_speeds():
    counters = {
        "a": {"prompt": 10, "draft": 5, "catch_up": 1, "verify": 20},
        "b": {"prompt": 8, "draft": 0, "catch_up": 0, "verify": 0},  # on standby: no speeds measured
    }
    speeds = {"a": {"prompt_s_per_token": 0.01, "decode_s_per_token": 0.1, "batch_s_per_token": 0.02}}
    assert floor_seconds(counters, speeds) == pytest.approx(10 * 0.01 + 6 * 0.1 + 20 * 0.02)


def test_the_reference_method_is_left_out_for_transformers_members_and_refused_when_asked():
    llama = check_reference(Plan(), ["smollm2-135m", "llama_cpp:gemma3-270m"])
    assert llama.reference is True and not llama.skipped
    mixed = check_reference(Plan(), ["smollm2-135m", "transformers:gemma3-270m"])
    assert mixed.reference is False and "reference method" in mixed.skipped[0]
    with pytest.raises(SegfuseError, match=r"llama\.cpp members only"):
        check_reference(Plan(reference=True), ["transformers:gemma3-270m"])
    assert check_reference(Plan(reference=False), ["smollm2-135m"]).reference is False


class Placed:
    """What settle reads of a loaded ensemble: its members' names and placements (pure logic)."""

    def __init__(self, *placements: str) -> None:
        self.members = [SimpleNamespace(name=f"m{i}", placement=p) for i, p in enumerate(placements)]


def test_rss_is_left_out_on_a_gpu_and_what_was_left_out_is_said():
    cpu = settle(Plan(response_level=False, users=0), Placed("CPU", "CPU"))
    assert cpu.rss is True
    assert set(cpu.skipped) == {"response level: --no-response-level", "users: --users 0"}
    gpu = settle(Plan(), Placed("CPU", "cuda:0"))
    assert gpu.rss is False and gpu.skipped == ("RSS: m1 on a GPU",)
    with pytest.raises(SegfuseError, match="add --no-rss"):
        settle(Plan(rss=True), Placed("GPU: 25/25 layers"))


def test_users_take_the_fixed_prompts_in_turn():
    assert len(user_prompts(4, 0)) == 4 and user_prompts(4, 0)[0] != user_prompts(4, 1)[0]
    assert user_prompts(4, 0)[3] == user_prompts(4, 0)[0]  # three prompts, the fourth user repeats the first


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, says",
    [
        (["--serve", "--users", "2"], "use `segfuse bench serve --users 2`"),
        (["speed", "--lengths", "12,x"], "not a list of token counts"),
        (["speed", "--reference", "-m", "transformers:smollm2-135m"], "add --no-reference"),
    ],
)
def test_bench_flags_are_checked_before_anything_loads(args, says):
    done = subprocess.run(
        [sys.executable, "-m", "segfuse.cli", "bench", *args], input="", capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.models
@pytest.mark.timeout(900)
def test_bench_times_a_transformers_leader_beside_a_llama_cpp_member(tmp_path):
    """The table for a mixed ensemble: the transformers leader against its own loop and Hugging Face's generate,
    the floor priced through both backends' raw speeds, two users at once, what was left out said."""
    args = ["--lengths", "4", "--reps", "1", "--users", "2", "--no-rss", "--no-response-level", "--out", str(tmp_path)]
    members = ["-m", "transformers:qwen2.5-coder-0.5b", "-m", "smollm2-135m"]
    done = subprocess.run(
        [sys.executable, "-m", "segfuse.cli", "bench", "speed", *members, *args],
        input="",
        capture_output=True,
        text=True,
        timeout=880,
        env={**os.environ, "COLUMNS": "240", "SEGFUSE_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["members"]["qwen2.5-coder-0.5b"]["backend"] == "transformers"
    assert report["members"]["smollm2-135m"]["backend"] == "llama_cpp"
    entry = report["lengths"]["4"]
    assert entry["fusion_tokens"]["median"] == entry["default_tokens"]["median"] == 4
    for row in ("floor", "members_sum", "leader_alone", "leader_generate", "fusion_at_once", "default_one_by_one"):
        assert entry[row]["median"] > 0, row
    for ratio in ("ratio_vs_floor", "default_over_leader_generate", "fusion_users_throughput"):
        assert entry[ratio] > 0, ratio
    assert "reference_method" not in entry and "response_level" not in entry and "rss_ratio" not in entry
    assert any("reference method" in why for why in report["skipped"])
    assert "default / generate" in done.stdout and "throughput ×" in done.stdout
