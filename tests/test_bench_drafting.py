"""`segfuse bench drafting` in its smallest form: one prompt per task, two tasks, 12 tokens, the llama.cpp rows
with the embedded models (qwen2.5-coder-0.5b leading, smollm2-135m drafting)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from segfuse.bench.speed.drafting import ANSWER_REFERENCE, MODES, DraftingPlan, run
from segfuse.bench.speed.drafting_table import table_rows

pytestmark = pytest.mark.models


def test_smallest_bench_compares_the_segfuse_answers(tmp_path: Path) -> None:
    plan = DraftingPlan(
        tasks=("edit", "gsm8k"),
        per_task=1,
        hf_per_task=0,
        max_tokens=12,
        leader="qwen2.5-coder-0.5b",
        drafters=("smollm2-135m",),
    )
    out = tmp_path / "bench-drafting.json"
    report = run(plan, out, log=lambda _: None)
    assert json.loads(out.read_text())["summary"] == report["summary"]
    systems = ["llama_alone", *MODES, "llama_pld"]
    assert [a["system"] for a in report["answers"]] == systems * 2
    for answer in report["answers"]:
        assert answer["tokens"] > 0 and answer["seconds"] > 0
        if answer["system"] in MODES:  # segfuse rows: compared with the leader alone's answer
            assert answer["reference"] == ANSWER_REFERENCE[answer["system"]]
            assert answer["identical"] == (answer["parts_at"] is None)
    llama = report["summary"]["llama"]
    assert set(llama) == set(systems)
    assert set(llama["members"]) == {"edit", "gsm8k", "all"}
    assert llama["llama_alone"]["all"]["ratio"] == 1.0
    assert llama["members"]["all"]["identical"] <= 2
    assert "smollm2-135m" in llama["members"]["all"]["acceptance"]
    assert len(table_rows(report["summary"])) == len(systems) * 3
    assert report["note"] == "transformers rows left out"
