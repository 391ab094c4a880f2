"""The GPU check, run end to end on the CPU: the pack (segfuse's own wheel and the embedded models' real
tokenizers; no dependency downloaded), then its ``check.py`` with every shape shrunk (``--small``), which
installs the wheel and runs every phase, with nothing installed but torch, transformers, what they require
and the pack's dependencies (as on the GPU machine)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, requires
from pathlib import Path

import pytest

from segfuse.bench.gpu import drafting
from segfuse.bench.gpu.models import DRAFTER_SHAPES, SHAPES, make_config, padded_vocab
from segfuse.bench.gpu.pack import DEPENDENCIES, MIB
from segfuse.engine.drafting import expected_tokens

PHASES = ["environment", "build", "load", "diagnose", "drafting", "warm_up", "table", "users"]


def test_vocabularies_are_padded_to_a_multiple_of_64():
    assert padded_vocab(49152) == 49152 and padded_vocab(151665) == 151680 and padded_vocab(1) == 64


class Tokenizer:
    """What make_config reads of a tokenizer: its size and special tokens (a unit test of pure logic)."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    def __len__(self) -> int:
        return 151665


def test_the_shapes_are_the_real_models_sizes():
    sized = Tokenizer()
    qwen = make_config(SHAPES[0], sized, small=False)
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_key_value_heads, qwen.vocab_size) == (
        3584,
        28,
        4,
        151680,
    )
    assert qwen.tie_word_embeddings is False and qwen.use_sliding_window is False
    theta = getattr(qwen, "rope_parameters", None) or {"rope_theta": qwen.rope_theta}
    assert theta["rope_theta"] == 1e6
    small = make_config(SHAPES[2], sized, small=True)
    assert (small.hidden_size, small.num_hidden_layers, small.head_dim, small.sliding_window) == (64, 2, 16, 512)


def test_the_drafting_prediction_is_the_planners_formula():
    # a free drafter whose every token is kept, read at the price of one token: k + 1 tokens a round
    assert drafting.speedup(1.0, 4, 0.0, 1.0) == pytest.approx(expected_tokens(1.0, 4))
    row = drafting.predict(drafting.ACCEPTANCES[0], 0.1, dict.fromkeys(drafting.DRAFT_LENGTHS, 1.2))
    assert row["best_speedup"] == max(row["speedup"].values()) and str(row["best_k"]) in row["speedup"]


def check_drafting(figures: dict) -> None:
    """The drafting rows: every pass timed, a batch no cheaper than about one token, a prediction per drafter."""
    assert all(ms > 0 for ms in figures["pass_ms"].values())
    assert set(figures["pass_ratio"]) == {str(k) for k in drafting.DRAFT_LENGTHS}
    # a pass of k + 1 tokens does at least one token's work (slack: timing noise of a busy CPU)
    assert all(r >= 0.7 for r in figures["pass_ratio"].values()), figures["pass_ratio"]
    drafters = {s.name for s in DRAFTER_SHAPES} | {"smollm2-1.7b"}
    assert all(figures["drafter_ratio"][d] > 0 for d in drafters) and figures["drafter_ratio"]["lookup"] == 0
    assert set(figures["best"]) == drafters | {"lookup"}
    for prediction in figures["predictions"]:
        assert prediction["best_speedup"] > 0 and prediction["best_k"] in drafting.DRAFT_LENGTHS
    assert figures["acceptance_source"] == drafting.SOURCE
    assert [t["title"].split(":")[0] for t in figures["tables"]] == ["drafting"] * 3


def _closure(names: list[str]) -> set[str]:
    """The distributions `names` need, with what they need in turn (extras left out), as installed here."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:  # not installed here: nothing to follow
            continue
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in needs if "extra ==" not in r]
    return seen


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_machine(into: Path) -> Path:
    """A folder of links to the installed files of torch, transformers, what they require, pip, and the pack's
    dependencies (which its wheels would install): the GPU machine's packages, nothing else (run with
    ``python -S``, nothing else is on the path)."""
    into.mkdir()
    for name in sorted(_closure(["torch", "transformers"]) | {"pip", *DEPENDENCIES}):
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        base = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (base / top).exists() and not (into / top).exists():
                (into / top).symlink_to(base / top)
    return into


@pytest.mark.models
@pytest.mark.timeout(600)
def test_the_pack_and_the_check_run_every_phase_on_the_cpu(tmp_path):
    pack, out = tmp_path / "pack", tmp_path / "out"
    made = subprocess.run(
        [sys.executable, "-m", "segfuse.bench.gpu.pack", "--out", str(pack), "--no-deps-download"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    manifest = json.loads((pack / "pack.json").read_text())
    assert manifest["git"]["commit"] and manifest["dependencies"] == "environment"
    assert {f for f in manifest["files"] if f.startswith("tokenizers/")} == {
        f"tokenizers/{s.tokenizer}.tar.gz" for s in SHAPES
    }
    assert manifest["size_bytes"] < 32 * MIB and f"{manifest['size_bytes'] / MIB:.1f} MiB" in made.stdout

    small = ["--small", "--device", "cpu", "--tokens", "6", "--reps", "1", "--users", "2", "--diagnose-tokens", "6"]
    site = gpu_machine(tmp_path / "site")
    done = subprocess.run(
        [sys.executable, "-S", str(pack / "check.py"), "--out", str(out), *small],
        capture_output=True,
        text=True,
        timeout=500,
        # one torch thread: on a busy 2-core machine two spin against other work (this checks the check, not them)
        env={**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"},
        cwd=Path(__file__).resolve().parents[1],  # the repository root, as on the GPU machine: src/ must not count
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads((out / "gpu-check.json").read_text())
    assert list(report["phases"]) == PHASES
    assert [p["status"] for p in report["phases"].values()] == ["done"] * len(PHASES), report["phases"]
    environment = report["phases"]["environment"]["figures"]
    assert "/src/segfuse/" not in environment["segfuse_file"]  # the installed wheel, not the source tree
    assert environment["packed"]["git"]["commit"] == manifest["git"]["commit"]
    assert environment["torch"] and environment["transformers"] and environment["python"]
    assert set(report["phases"]["load"]["figures"]["members"]) == {s.name for s in SHAPES}
    diagnosis = report["phases"]["diagnose"]["figures"]
    for place in ("main_thread", "new_thread", "new_thread_cudnn_sdp", "new_thread_no_cudnn_sdp"):
        assert diagnosis[place]["median"] > 0 and diagnosis[place]["ms_per_token"] > 0, place
    check_drafting(report["phases"]["drafting"]["figures"])
    assert "predicted speed-up" in done.stdout and drafting.SOURCE in done.stdout
    entry = report["bench"]["lengths"]["6"]
    assert entry["fusion_tokens"]["median"] == entry["default_tokens"]["median"] == 6
    for key in ("fusion", "floor", "members_sum", "default", "leader_alone", "leader_generate", "fusion_at_once"):
        assert entry[key]["median"] > 0, key
    for ratio in ("ratio_vs_floor", "default_over_leader_alone", "default_over_leader_generate"):
        assert entry[ratio] > 0, ratio
    assert "fusion_users_throughput" in entry and "default_users_throughput" in entry
    assert [t["system"] for t in report["bench"]["tables"]] == ["plain fusion", "default (leader alone)"]
    # It needed nothing beyond torch, transformers and theirs but segfuse and the pack's dependencies (there was
    # nothing else), and it imported each of those: the list is not longer than it must be.
    assert {_norm(d) for d in (*DEPENDENCIES, "segfuse")} <= {_norm(d) for d in report["imported"]}
