"""`segfuse bench` as subcommands (pure CLI logic, no model loads): the subcommands it lists, the flags each
takes and shows, plain `segfuse bench` running `speed`, and the old flag spellings answered with the new."""

from __future__ import annotations

import re
from itertools import pairwise

import pytest
from typer.testing import CliRunner

from segfuse.cli import app
from segfuse.cli.bench import new_spelling
from segfuse.errors import SegfuseError

# Every subcommand with exactly the long flags it takes (its --help shows these and no other).
SERVING = {"--max-tokens", "--model", "--threads", "--out"}  # what serve, followers, soak and ray all take
FLAGS = {
    "speed": {
        "--model",
        "--lengths",
        "--reps",
        "--window",
        "--out",
        "--rss",
        "--reference",
        "--response-level",
        "--users",
    },
    "drafting": {
        "--tasks",
        "--per-task",
        "--hf-per-task",
        "--max-tokens",
        "--threads",
        "--data",
        "--leader",
        "--drafters",
        "--hf-leader",
        "--hf-drafter",
        "--draft-max",
        "--out",
    },
    "serve": SERVING | {"--concurrency", "--requests", "--max-concurrent", "--remote", "--cache-dir"},
    "users": {"--users", "--tokens", "--reps", "--threads", "--out"},
    "chat": {"--reps", "--max-tokens", "--threads", "--out"},
    "followers": SERVING | {"--concurrency", "--requests"},
    "soak": SERVING | {"--seed", "--requests", "--max-concurrent", "--remote", "--ray", "--replicas", "--cache-dir"},
    "ray": SERVING | {"--concurrency", "--requests", "--reps", "--max-concurrent", "--replicas", "--cache-dir"},
    "gpu": {
        "--pack",
        "--out",
        "--budget",
        "--small",
        "--device",
        "--dtype",
        "--tokens",
        "--reps",
        "--users",
        "--window",
        "--diagnose-tokens",
    },
    "ensembles": {"--requests", "--in-flight", "--max-tokens", "--out", "--budget"},
}
WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=WIDE)


def listed_flags(help_text: str) -> set[str]:
    """The flags in the first column of a --help's options table (not those its descriptions mention)."""
    return set(re.findall(r"^│ (--[a-z][a-z-]*)", help_text, flags=re.MULTILINE)) - {"--help"}


def test_bench_help_lists_every_subcommand_in_order():
    done = invoke("bench", "--help")
    assert done.exit_code == 0, done.output
    listed = re.findall(r"^│ ([a-z]+) {2,}", done.output, flags=re.MULTILINE)
    assert listed == list(FLAGS), done.output
    assert "runs `segfuse bench speed` at its defaults" in " ".join(done.output.split())


def test_bench_help_wraps_each_description_to_the_terminal():
    """Each subcommand's first paragraph, wrapped to the table's width: no line ends where the next line's first
    word would still have fit (the docstrings' hard line breaks used to show: "drafts and votes every round)",
    then "against its members, ..." on the next line, at 80 columns)."""
    done = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert done.exit_code == 0, done.output
    panel = done.output[done.output.index("─ Commands ─") :]
    rows = re.findall(r"^│ ([a-z]*) +(\S.*?) *│$", panel, flags=re.MULTILINE)
    width = max(len(text) for _, text in rows)  # at most the column's: a line as long as it could be
    descriptions: list[list[str]] = []
    for name, text in rows:
        if name:
            descriptions.append([])
        descriptions[-1].append(text)
    assert len(descriptions) == len(FLAGS), done.output
    for lines in descriptions:
        for line, after in pairwise(lines):
            assert len(line) + 1 + len(after.split()[0]) > width, (line, after)


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_each_subcommand_takes_and_shows_only_its_own_flags(name):
    done = invoke("bench", name, "--help")
    assert done.exit_code == 0, done.output
    assert listed_flags(done.output) == FLAGS[name]


def test_a_flag_of_another_benchmark_is_refused_by_the_subcommand():
    done = invoke("bench", "chat", "--concurrency", "1,2")
    assert done.exit_code == 2 and "No such option" in done.output
    done = invoke("bench", "speed", "--cache-dir", "x")
    assert done.exit_code == 2 and "No such option" in done.output


@pytest.mark.parametrize(
    "old, new",
    [
        ("--serve", "serve"),
        ("--serve --concurrency 1,2 --requests 4", "serve --concurrency 1,2 --requests 4"),
        ("--serve --chat --reps 2", "chat --reps 2"),
        ("--serve --followers", "followers"),
        ("--serve --soak 10m", "soak 10m"),
        ("--serve --soak 30m --ray --threads 1", "soak 30m --ray --threads 1"),
        ("--soak=90s --seed 3", "soak 90s --seed 3"),
        ("--ray", "ray"),
        ("--serve --ray --threads 1 --reps 4", "ray --threads 1 --reps 4"),
        ("--lengths 12 --reps 1 --no-rss", "speed --lengths 12 --reps 1 --no-rss"),
        ("-m smollm2-135m", "speed -m smollm2-135m"),
    ],
)
def test_an_old_spelling_says_exactly_what_to_type_instead(old, new):
    assert new_spelling(old.split()) == new.split()
    done = invoke("bench", *old.split())
    assert isinstance(done.exception, SegfuseError), done.output
    assert done.exception.hint.startswith(f"use `segfuse bench {new}`")
    assert f"`segfuse bench {old}`" in done.exception.message


def test_plain_bench_runs_speed_at_its_defaults(monkeypatch):
    import segfuse.cli.bench as bench

    ran = []
    monkeypatch.setattr(bench, "_bench_local", lambda plan, model, out: ran.append((plan, model, out)))
    done = invoke("bench")
    assert done.exit_code == 0, done.output
    ((plan, model, out),) = ran
    assert (plan.lengths, plan.reps, plan.window, plan.users, plan.response_level) == ((128, 256), 3, 10, 4, True)
    assert plan.rss is None and plan.reference is None and model is None and out == "runs/bench"
    ran.clear()
    assert invoke("bench", "speed", "--lengths", "12", "--reps", "1", "--no-rss", "--users", "0").exit_code == 0
    ((plan, _, _),) = ran
    assert (plan.lengths, plan.reps, plan.rss, plan.users) == ((12,), 1, False, 0)


def test_the_soak_refuses_replicas_without_ray_before_anything_starts():
    done = invoke("bench", "soak", "1m", "--replicas", "2")
    assert isinstance(done.exception, SegfuseError) and "add --ray" in done.exception.hint


def test_the_gpu_check_wants_its_pack(tmp_path):
    done = invoke("bench", "gpu", "--pack", str(tmp_path), "--out", str(tmp_path / "out"))
    assert isinstance(done.exception, SegfuseError) and "make gpu-pack" in done.exception.hint
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # imports torch and transformers (the command's extra)
def test_the_gpu_subcommand_runs_the_check_as_its_pack_would(tmp_path, monkeypatch):
    """`segfuse bench gpu` hands the check the settings `check.py` would for the same flags (the defaults
    agree), and exits with the check's status."""
    from segfuse.bench.gpu import check as gpu_check

    (tmp_path / "tokenizers").mkdir()
    given = ["--pack", str(tmp_path), "--out", str(tmp_path / "out"), "--small", "--device", "cpu", "--tokens", "6"]
    seen = []
    monkeypatch.setattr(gpu_check, "run", lambda args: seen.append(args) or 1)  # 1: a phase failed
    done = invoke("bench", "gpu", *given)
    assert done.exit_code == 1, done.output
    [args] = seen
    assert vars(args) == vars(gpu_check.parse(given))
