"""`segfuse score`, the study's recorder and report, and `segfuse calibrate pooling`, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.models  # each runs the embedded members in a subprocess

SEGFUSE = [sys.executable, "-m", "segfuse.cli"]
TWO = ["-m", "smollm2-135m", "-m", "gemma3-270m", "--threads", "1", "--prefix-cache-cells", "0"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SEGFUSE_THREADS": "1"}
    return subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=600, check=False)


def test_score_prints_every_member_and_the_pool_as_json_and_as_a_table():
    done = _run(
        *SEGFUSE,
        "score",
        "Q: What is the capital of France?\nA: ",
        "Paris",
        "Berlin",
        "a potato",
        *TWO,
        "--rule",
        "loglinear-whole",
        "--json",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert [c["text"] for c in data["choices"]] == [" Paris", " Berlin", " a potato"]
    assert data["weights"] == {"smollm2-135m": 0.5, "gemma3-270m": 0.5}
    for choice in data["choices"]:
        rows = choice["members"].values()
        assert choice["fused"] == sum(r["logprob"] for r in rows) / 2
        assert all(r["tokens"] >= 1 and r["bytes"] == len(choice["text"].encode()) for r in rows)
    assert sum(c["best"] for c in data["choices"]) == 1
    table = _run(*SEGFUSE, "score", "The sky is ", "blue", "green", "-m", "smollm2-135m", "--threads", "1")
    assert table.returncode == 0, table.stderr[-2000:]
    assert "smollm2-135m" in table.stdout and "' blue'" in table.stdout and "←" in table.stdout


def test_score_refuses_bad_input_clearly():
    empty = _run(*SEGFUSE, "score", "Q: hi\nA:", "yes", "", "-m", "smollm2-135m", "--threads", "1")
    assert empty.returncode == 2 and "choice 1 is empty" in empty.stderr
    rule = _run(*SEGFUSE, "score", "Q: hi\nA:", "yes", "-m", "smollm2-135m", "--rule", "median")
    assert rule.returncode == 2 and "unknown pooling rule" in rule.stderr
    weight = _run(*SEGFUSE, "score", "Q: hi\nA:", "yes", "-m", "smollm2-135m", "--weight", "smollm2-135m")
    assert weight.returncode == 2 and "bad --weight" in weight.stderr


def test_study_records_resume_and_calibrate_fits_pooling_weights(tmp_path):
    study = [
        sys.executable,
        "-m",
        "segfuse.eval.likelihood_study",
        "--models",
        "smollm2-135m|gemma3-270m",
        "--tasks",
        "arithmetic-2_digit_addition",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "study"),
    ]
    first = _run(*study, "--start", "0", "--stop", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    again = _run(*study, "--start", "0", "--stop", "3")  # resumes: only item 2 is new
    assert again.returncode == 0, again.stderr[-2000:]
    path = tmp_path / "study" / "arithmetic-2_digit_addition.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert again.stderr.count("arithmetic-2_digit_addition ") == 1
    assert set(records[0]["members"]) == {"smollm2-135m", "gemma3-270m"} and records[0]["correct"] == [6]

    fitted = _run(
        *SEGFUSE,
        "calibrate",
        "pooling",
        "--data",
        str(tmp_path / "study"),
        "--rule",
        "mixture-byte",
        "--out",
        str(tmp_path / "cal"),
    )
    assert fitted.returncode == 0, fitted.stderr[-2000:]
    saved = json.loads((tmp_path / "cal" / "pooling.json").read_text())
    assert saved["rule"] == "mixture-byte" and saved["items"] == 3
    assert abs(sum(saved["weights"].values()) - 1) < 1e-9 and saved["right"] >= saved["right_uniform"]
    assert "--weight smollm2-135m=" in " ".join(fitted.stderr.split())  # as wrapped to the terminal's width

    report = _run(sys.executable, "-m", "segfuse.eval.likelihood_report", str(tmp_path / "study"))
    assert report.returncode == 0, report.stderr[-2000:]
    assert "loglinear-byte uniform" in report.stdout and "← chosen" in report.stdout
