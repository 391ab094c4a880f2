"""`segfuse calibrate` and profiles: the choice rule on hand-made figures, the user's own JSONL tasks,
profiles loaded under command-line flags, and a tiny real calibration whose profile `generate` loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from segfuse.errors import InvalidRequestError
from segfuse.eval.calibrate import LEADER_ALONE, Setting, choose, compare
from segfuse.eval.tasks import jsonl_task
from segfuse.profiles import load_profile, write_profile

SEGFUSE = [sys.executable, "-m", "segfuse.cli"]
QUESTIONS = [
    ("What is 2 + 2?", "4"),
    ("What is 3 + 5?", "8"),
    ("What is 10 - 7?", "3"),
    ("What is 6 times 7?", "42"),
    ("What is 9 + 1?", "10"),
    ("What is 12 / 4?", "3"),
    ("What is 5 + 5?", "10"),
    ("What is 7 - 2?", "5"),
    ("What is 2 times 8?", "16"),
    ("What is 100 - 1?", "99"),
    ("What is 1 + 1?", "2"),
]


def record(system, i, correct, seconds=1.0):
    return {"system": system, "id": f"jsonl-{i}", "correct": correct, "total_s": seconds}


def test_compare_pairs_each_setting_with_the_leader_item_by_item():
    leader = "member:big"
    records = [record(leader, i, i < 5, 2.0) for i in range(10)]
    records += [record("fusion:gate=0.5/accept_margin=1.0", i, i < 6 and i != 0, 2.2) for i in range(10)]
    records += [record("fusion:gate=0.5/accept_margin=none", i, i < 4, 3.0) for i in range(10)]
    records.append({"system": leader, "id": "jsonl-99", "correct": True, "total_s": 1.0})  # not paired: left out
    settings = compare(
        records,
        {f"jsonl-{i}" for i in range(10)},
        [leader, "fusion:gate=0.5/accept_margin=1.0", "fusion:gate=0.5/accept_margin=none"],
    )
    first, second = settings
    assert (first.correct, first.items, first.only_this, first.only_leader, first.leader_correct) == (5, 10, 1, 1, 5)
    assert first.time_ratio == pytest.approx(1.1)
    assert (second.correct, second.only_leader) == (4, 1)
    assert choose(settings).spec == LEADER_ALONE  # a tie (5 against 5) is not worth 1.1x the time


def test_choose_takes_the_cheapest_setting_that_gains_or_the_leader_alone():
    def setting(spec, correct, ratio):
        return Setting(spec, correct, 20, 0, 0, ratio, 8)

    assert choose([setting("a", 10, 1.3), setting("b", 9, 1.1), setting("c", 8, 1.0)]).spec == "b"
    alone = choose([setting("a", 8, 1.3), setting("c", 5, 1.0)])
    assert alone.spec == LEADER_ALONE and alone.correct == 8 and alone.time_ratio == 1.0


def test_a_profile_round_trips_none_and_rejects_what_fusion_options_reject(tmp_path):
    path = write_profile(tmp_path / "p.toml", {"gate": 0.5, "accept_margin": None}, {"task": "ifeval", "items": 40})
    assert 'accept_margin = "none"' in path.read_text()
    assert load_profile(path) == {"gate": 0.5, "accept_margin": None}
    (tmp_path / "bad.toml").write_text("[fusion]\nwindow = 0\n")
    with pytest.raises(InvalidRequestError, match="window"):
        load_profile(tmp_path / "bad.toml")
    (tmp_path / "empty.toml").write_text("[calibration]\nitems = 3\n")
    with pytest.raises(InvalidRequestError, match="no \\[fusion\\] table"):
        load_profile(tmp_path / "empty.toml")
    with pytest.raises(InvalidRequestError, match="not found"):
        load_profile(tmp_path / "missing.toml")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_tasks_check_answers_and_say_what_is_wrong_with_the_file(tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [{"prompt": q, "answer": a} for q, a in QUESTIONS])
    number, contains = jsonl_task("number"), jsonl_task("contains")
    items = number.load(data)
    assert len(items) == len(QUESTIONS) and items[3].prompt == "What is 6 times 7?"
    assert number.score(items[3], "6 times 7 is 42.")["correct"]
    assert not number.score(items[3], "It is 41.")["correct"]
    assert contains.score(items[3], "The answer: 42!")["correct"]
    with pytest.raises(InvalidRequestError, match="needs a checker"):
        jsonl_task(None)
    with pytest.raises(InvalidRequestError, match="unknown checker"):
        jsonl_task("vibes")
    with pytest.raises(InvalidRequestError, match='line 2 has no "answer"'):
        number.load(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(InvalidRequestError, match="line 2 is not JSON"):
        number.load(tmp_path / "broken.jsonl")


def test_a_python_checker_is_the_users_own_function(tmp_path, monkeypatch):
    (tmp_path / "mycheck.py").write_text("def is_short(row, output):\n    return len(output) < row['limit']\n")
    monkeypatch.chdir(tmp_path)
    task = jsonl_task("python:mycheck:is_short")
    [item] = task.load(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "Say hi.", "limit": 10}]))
    assert task.score(item, "hi")["correct"] and not task.score(item, "hello there, friend")["correct"]


def run_cli(*args, timeout=900):
    return subprocess.run([*SEGFUSE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_calibrate_refuses_too_few_items_and_a_missing_checker(tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [{"prompt": q, "answer": a} for q, a in QUESTIONS[:4]])
    few = run_cli("calibrate", "jsonl", "--data", str(data), "--checker", "number", "--out", str(tmp_path / "o"))
    assert few.returncode == 2 and "at least 10 items; 4 were given" in few.stderr
    unchecked = run_cli("calibrate", "jsonl", "--data", str(data), "--out", str(tmp_path / "o"))
    assert unchecked.returncode == 2 and "needs a checker" in unchecked.stderr


@pytest.mark.models
@pytest.mark.timeout(900)
def test_a_tiny_real_calibration_writes_a_profile_that_generate_loads(tmp_path):
    data = write_jsonl(
        tmp_path / "q.jsonl", [{"prompt": q + " Answer with the number only.", "answer": a} for q, a in QUESTIONS[:10]]
    )
    members = ["-m", "smollm2-135m", "-m", "qwen2.5-coder-0.5b"]
    out = tmp_path / "cal"
    args = [
        "calibrate",
        "jsonl",
        "--data",
        str(data),
        "--checker",
        "number",
        *members,
        "--max-tokens",
        "12",
        "--threads",
        "1",
        "--setting",
        "gate=0.5/accept_margin=2.0",
        "--setting",
        "gate=0.9/accept_margin=none",
        "--out",
        str(out),
        "--no-progress",
    ]
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    profile = out / "profile.toml"
    fusion = load_profile(profile)
    text = profile.read_text()
    assert 'leader = "qwen2.5-coder-0.5b"' in text and "[calibration.chosen]" in text
    assert set(fusion) <= {"gate", "accept_margin"} and "profile:" in done.stderr
    records = [json.loads(line) for line in (out / "jsonl.jsonl").read_text().splitlines()]
    assert len(records) == 30  # the leader and two settings on ten items
    assert run_cli(*args).returncode == 0  # resumed: everything is recorded, nothing runs again
    assert len((out / "jsonl.jsonl").read_text().splitlines()) == 30

    # generate loads a profile under its flags: every round a vote (gate 1.5) unless --gate says otherwise
    (tmp_path / "vote.toml").write_text('[fusion]\ngate = 1.5\naccept_margin = "none"\n')
    generate = ["generate", "--json", *members, "--threads", "1", "--max-tokens", "8"]
    base = [*generate, "--temperature", "0", "--profile", str(tmp_path / "vote.toml"), "What is 2 + 2?"]
    voted = json.loads(run_cli(*base).stdout)
    assert voted["rounds"] and not any(r["gated"] for r in voted["rounds"])
    gated = json.loads(run_cli(*base, "--gate", "0").stdout)
    assert all(r["gated"] for r in gated["rounds"])
    with_calibrated = run_cli(*generate, "--profile", str(profile), "What is 2 + 2?")
    assert with_calibrated.returncode == 0 and json.loads(with_calibrated.stdout)["text"]
