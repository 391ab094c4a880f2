"""The evaluation harness: metrics, IFEval scoring, real end-to-end runs, resume, reports."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from lm_eval_cli import run_lm_eval
from segfuse.errors import InvalidRequestError
from segfuse.eval.report import (
    build_report,
    comparisons,
    coverage_groups,
    latest,
    mcnemar_p,
    paired,
    summarise,
    wilson,
)
from segfuse.eval.runner import carried_weights, read_records
from segfuse.eval.systems import resolve_systems
from segfuse.eval.tasks import GSM8K, IFEVAL, Item, extract_number, gsm8k_reference, parse_number, score_gsm8k
from segfuse.likelihood import Rule

SEGFUSE = [sys.executable, "-m", "segfuse.cli"]


# --- GSM8K metric --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234", 1234),
        ("$5.50", 5.5),
        ("-3", -3),
        ("12.0", 12),
        ("the answer is 7 apples", 7),
        (r"so we get \boxed{42} in the end, not 41", 42),
        (r"\boxed{1,000}", 1000),
        ("She earns 9 * 2 = 18 dollars.\nThe answer is $18.", 18),
        ("The answer is: **1,250**.", 1250),
        ("#### 72", 72),
        ("The answer is 18. Check: 16 - 3 - 4 = 9 eggs.", 18),  # the stated answer beats the last number
        ("First 5, then 6, finally 11.", 11),  # no stated answer: the last number
        ("half is 1/2", 0.5),
        ("It costs 3.", 3),
        ("no digits here", None),
    ],
)
def test_extract_number(text, expected):
    got = extract_number(text)
    assert got == (None if expected is None else pytest.approx(expected))


def test_reference_and_scoring():
    assert gsm8k_reference("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == 18
    assert gsm8k_reference("#### 1,000") == 1000
    assert parse_number("12.50.") == 12.5 and parse_number("abc") is None
    assert parse_number("1" * 400) is None  # a looping answer's endless digits do not crash the scorer
    assert not score_gsm8k(Item("gsm8k-1", 1, "q", 3.0), "The answer is " + "9" * 400)["correct"]
    item = Item("gsm8k-0", 0, "q", 18.0)
    assert score_gsm8k(item, "So the answer is 18.0 dollars.")["correct"]
    assert not score_gsm8k(item, "The answer is 19.")["correct"]
    assert not score_gsm8k(item, "I do not know.")["correct"]


def test_gsm8k_loads_local_data_with_offset():
    items = GSM8K.load(offset=5, limit=3)
    assert [i.index for i in items] == [5, 6, 7] and items[0].id == "gsm8k-5"
    assert "Question:" in items[0].prompt and isinstance(items[0].reference, float)


# --- IFEval through lm-eval's implementation -----------------------------------


def _ifeval_item(instructions, kwargs, prompt="Write something."):
    doc = {"key": 1, "prompt": prompt, "instruction_id_list": instructions, "kwargs": kwargs}
    return Item("ifeval-1", 0, prompt, doc)


@pytest.mark.slow
def test_ifeval_known_pass_and_fail():
    no_comma = _ifeval_item(["punctuation:no_comma"], [{}])
    assert IFEVAL.score(no_comma, "Short text without that mark.")["prompt_level_strict_acc"]
    assert not IFEVAL.score(no_comma, "One, two.")["prompt_level_strict_acc"]

    lower = _ifeval_item(["change_case:english_lowercase", "punctuation:no_comma"], [{}, {}])
    scored = IFEVAL.score(lower, "all lower case here, with a comma")
    assert scored["inst_level_strict_acc"] == [True, False] and not scored["correct"]

    # Sentence counting uses NLTK's Punkt data, provided offline (nltk_offline.py).
    sentences = _ifeval_item(["length_constraints:number_sentences"], [{"relation": "less than", "num_sentences": 3}])
    assert IFEVAL.score(sentences, "Mr. Smith went home. He slept.")["correct"]
    assert not IFEVAL.score(sentences, "One. Two. Three. Four.")["correct"]

    # Loose accuracy forgives a first line of chatter; strict does not.
    title = _ifeval_item(["detectable_format:title"], [{}])
    assert IFEVAL.score(title, "<<A Poem>>\nroses")["prompt_level_strict_acc"]
    assert not IFEVAL.score(title, "A poem")["prompt_level_loose_acc"]


def test_ifeval_scores_one_answer_the_same_every_time():
    # lm_eval picks a random letter to count when the item's is not a-z (IFEval item 1129 asks for 6 "!"),
    # so without a seed the same answer scored differently from one call to the next.
    item = _ifeval_item(
        ["keywords:letter_frequency"], [{"let_relation": "at least", "letter": "!", "let_frequency": 6}]
    )
    answer = "Sunnis ice cream! Gentle! On the stomach! Try it! Today! Now! " + "abcdefghijklmnopqrstuvwxyz " * 3
    scores = {IFEVAL.score(item, answer)["inst_level_loose_acc"][0] for _ in range(20)}
    assert len(scores) == 1


def test_punkt_data_is_written_in_nltk_format(tmp_path, monkeypatch):
    import nltk
    from nltk.tokenize.punkt import PunktTokenizer

    from segfuse.eval.nltk_offline import write_punkt_tab

    write_punkt_tab(tmp_path)
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # only the folder just written
    tokenizer = PunktTokenizer("english")
    assert tokenizer.tokenize("Dr. Watson met Mr. Holmes. They talked.") == [
        "Dr. Watson met Mr. Holmes.",
        "They talked.",
    ]


# --- systems and reports on hand-made records -----------------------------------


def test_resolve_systems_expands_members_and_orders_them_first():
    names = ["a", "b"]
    assert resolve_systems("specfuse,members,rerank", names) == ["member:a", "member:b", "specfuse", "rerank"]
    with pytest.raises(InvalidRequestError):
        resolve_systems("member:c", names)
    with pytest.raises(InvalidRequestError):
        resolve_systems("nonsense", names)


def test_wilson_interval():
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 0) == (0.0, 0.0)


def gsm8k_record(i: int, system: str, ok: bool, **fields) -> dict:
    """A GSM8K record of `system` on item `i` as the runner writes one; `fields` add to it or replace."""
    return {
        "id": f"gsm8k-{i}",
        "index": i,
        "system": system,
        "correct": ok,
        "exact_match": ok,
        "total_s": 1.0,
        "ttft_s": 0.5,
        "member_calls": 3,
        "tokens": 10,
        **fields,
    }


def test_summary_uses_only_items_every_system_finished():
    def rec(i, system, ok):
        return gsm8k_record(i, system, ok, wins={"x": 2, "y": 1} if system == "specfuse" else None)

    records = [rec(0, "specfuse", True), rec(0, "rerank", False), rec(1, "specfuse", True)]
    rows, common = summarise(GSM8K, records)
    assert common == ["gsm8k-0"]
    assert {r.system: r.accuracy["exact_match"] for r in rows} == {"specfuse": (1, 1), "rerank": (0, 1)}
    assert rows[0].wins == {"x": 2, "y": 1}


@pytest.mark.slow
def test_systems_that_went_further_get_their_own_section(tmp_path):
    def rec(i, system, ok):
        return gsm8k_record(i, system, ok, rounds=1)

    # `specfuse` and `rerank` finished items 0-3, `specfuse+exit` only 0-1, `member:a` 0-2.
    coverage = {"member:a": 3, "specfuse": 4, "rerank": 4, "specfuse+exit": 2}
    records = [rec(i, s, i % 2 == 0) for s, n in coverage.items() for i in range(n)]
    groups = coverage_groups(records)
    assert groups == [
        (["member:a", "specfuse", "rerank", "specfuse+exit"], ["gsm8k-0", "gsm8k-1"]),
        (["member:a", "specfuse", "rerank"], ["gsm8k-0", "gsm8k-1", "gsm8k-2"]),
        (["specfuse", "rerank"], ["gsm8k-0", "gsm8k-1", "gsm8k-2", "gsm8k-3"]),
    ]
    rows, common = summarise(GSM8K, records, ["specfuse", "rerank"])
    assert len(common) == 4 and [r.accuracy["exact_match"] for r in rows] == [(2, 4), (2, 4)]

    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = build_report(tmp_path).read_text()
    assert "2 items finished by every system" in report
    assert "### gsm8k: the systems that finished 4 items" in report
    assert "finished by `specfuse`, `rerank`." in report
    assert (tmp_path / "gsm8k_accuracy_vs_time.png").is_file()
    assert (tmp_path / "gsm8k_n3_accuracy_vs_time.png").is_file()
    assert (tmp_path / "gsm8k_n4_accuracy_vs_time.png").is_file()


def test_mcnemar_exact_p_values():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 5) == 1.0
    assert mcnemar_p(0, 6) == pytest.approx(2 / 64)  # all six discordant items one way
    assert mcnemar_p(1, 9) == pytest.approx(2 * 11 / 1024)
    assert mcnemar_p(9, 1) == mcnemar_p(1, 9)


def test_paired_comparison_and_calls_per_round():
    def rec(i, system, ok, calls=6, rounds=None):
        return gsm8k_record(i, system, ok, member_calls=calls, rounds=rounds)

    outcomes = {"member:a": [1, 1, 0, 0], "specfuse": [1, 0, 0, 1], "specfuse+exit": [1, 1, 1, 0]}
    records = [
        rec(i, s, bool(ok), calls=6 if s == "specfuse" else 3, rounds=None if s.startswith("member") else 2)
        for s, row in outcomes.items()
        for i, ok in enumerate(row)
    ]
    rows, common = summarise(GSM8K, records)
    by = {r.system: r for r in rows}
    assert by["specfuse"].calls_per_round == 3.0 and by["specfuse+exit"].calls_per_round == 1.5
    assert by["member:a"].calls_per_round is None
    c = paired(GSM8K, latest(records), common, "specfuse+exit", "specfuse")
    assert (c.n, c.only_a, c.only_b, c.difference) == (4, 2, 1, 0.25)
    text = comparisons(GSM8K, rows, records, common)
    assert "| `specfuse+exit` | `specfuse` | +25.0% | 2 | 1 | 1.000 |" in text
    assert "| `specfuse` | `member:a` | +0.0% | 1 | 1 | 1.000 |" in text


def test_carried_weights_resume_from_the_latest_earlier_item():
    records = [
        {"system": "specfuse+hedge", "index": 0, "weights": {"a": 0.6, "b": 0.4}},
        {"system": "specfuse+hedge", "index": 1, "weights": {"a": 0.7, "b": 0.3}},
        {"system": "specfuse+hedge", "index": 5, "weights": {"a": 0.1, "b": 0.9}},  # after the resume point
        {"system": "specfuse", "index": 1, "weights": {"a": 0.5, "b": 0.5}},
        {"system": "member:a", "index": 1, "weights": None},
    ]
    assert carried_weights(records, {"specfuse+hedge": 2, "member:a": 2}) == {"specfuse+hedge": {"a": 0.7, "b": 0.3}}
    assert carried_weights(records, {"specfuse+hedge": 0}) == {}


# --- real runs through the CLI --------------------------------------------------


def _cli(*args, check=True):
    env = {**os.environ, "SEGFUSE_THREADS": os.environ.get("SEGFUSE_THREADS", "1")}
    done = subprocess.run([*SEGFUSE, *args], capture_output=True, text=True, env=env, timeout=600)
    if check:
        assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory):
    """Every system on two GSM8K items with short answers: the real models, end to end."""
    out = tmp_path_factory.mktemp("eval")
    args = (
        "eval",
        "gsm8k",
        "--limit",
        "2",
        "--max-tokens",
        "24",
        "--systems",
        "specfuse,rerank,members",
        "--out",
        str(out),
        "--no-progress",
    )
    done = _cli(*args)
    return out, args, done


@pytest.mark.models
def test_cli_run_writes_records_table_and_plots(gsm8k_run):
    out, _, done = gsm8k_run
    records = read_records(out / "gsm8k.jsonl")
    systems = {r["system"] for r in records}
    assert systems == {"specfuse", "rerank", "member:smollm2-135m", "member:qwen2.5-coder-0.5b", "member:gemma3-270m"}
    assert len(records) == 10 and {r["id"] for r in records} == {"gsm8k-0", "gsm8k-1"}
    for r in records:
        assert isinstance(r["correct"], bool) and r["reference"] in (18.0, 3.0)
        assert r["total_s"] > 0 and r["member_calls"] >= 1 and 0 <= r["tokens"] <= 24
        assert r["ttft_s"] is None or r["ttft_s"] <= r["total_s"] + 1e-6
    fused = [r for r in records if r["system"] == "specfuse"]
    assert all(sum(r["wins"].values()) == r["rounds"] for r in fused)
    reranked = [r for r in records if r["system"] == "rerank"]
    for r in reranked:
        assert r["ttft_s"] == r["total_s"] and sum(r["wins"].values()) == 1
        # The winner is one of the members' own answers, written once and reused.
        alone = {
            x["system"].split(":", 1)[1]: x["output"]
            for x in records
            if x["id"] == r["id"] and x["system"].startswith("member:")
        }
        winner = next(m for m, w in r["wins"].items() if w)
        assert r["output"] == alone[winner]
    assert "| `specfuse` | 2 |" in done.stdout
    assert (out / "gsm8k_accuracy_vs_time.png").stat().st_size > 1000
    assert (out / "gsm8k_segment_wins.png").stat().st_size > 1000


@pytest.mark.models
def test_resume_skips_finished_items(gsm8k_run):
    out, args, _ = gsm8k_run
    before = (out / "gsm8k.jsonl").read_text()
    _cli(*args)
    assert (out / "gsm8k.jsonl").read_text() == before
    # A resumed run with other settings is refused instead of mixing results.
    clash = _cli(*[a if a != "24" else "32" for a in args], check=False)
    assert clash.returncode == 2 and "other settings" in clash.stderr


@pytest.mark.models
def test_hedge_persist_carries_weights_across_items_and_resumes(tmp_path):
    base = ("eval", "gsm8k", "--max-tokens", "16", "--systems", "specfuse+hedge", "--no-progress")
    _cli(*base, "--limit", "2", "--out", str(tmp_path / "fresh"))
    _cli(*base, "--limit", "2", "--hedge-persist", "--out", str(tmp_path / "carried"))
    _cli(*base, "--limit", "1", "--hedge-persist", "--out", str(tmp_path / "resumed"))
    _cli(*base, "--limit", "2", "--hedge-persist", "--out", str(tmp_path / "resumed"))
    fresh, carried, resumed = (read_records(tmp_path / d / "gsm8k.jsonl") for d in ("fresh", "carried", "resumed"))
    # The first item starts from uniform weights either way; the second starts from the first's weights.
    assert carried[0]["weights"] == fresh[0]["weights"]
    assert carried[1]["weights"] != fresh[1]["weights"]
    assert [r["weights"] for r in resumed] == [r["weights"] for r in carried]
    assert [r["output"] for r in resumed] == [r["output"] for r in carried]
    # Mixing a carried and an uncarried run in one folder is refused.
    clash = _cli(*base, "--limit", "2", "--out", str(tmp_path / "carried"), check=False)
    assert clash.returncode == 2 and "other settings" in clash.stderr


@pytest.mark.models
def test_report_rebuilds_from_jsonl(gsm8k_run):
    out, _, _ = gsm8k_run
    for name in ("report.md", "gsm8k_accuracy_vs_time.png", "gsm8k_segment_wins.png"):
        (out / name).unlink()
    done = _cli("eval", "--report", str(out))
    report = (out / "report.md").read_text()
    assert report == done.stdout
    assert "2 items finished by every system" in report
    assert len(re.findall(r"^\| `[^`]+` \| 2 \|", report, flags=re.M)) == 5  # one table row per system
    assert "| `specfuse` | `rerank` |" in report  # the paired comparison
    assert (out / "gsm8k_accuracy_vs_time.png").is_file() and (out / "gsm8k_segment_wins.png").is_file()
    assert build_report(out) == out / "report.md"


@pytest.mark.models
def test_ifeval_run_in_process(tmp_path):
    from segfuse.eval.runner import run_eval

    path = run_eval(
        "ifeval",
        tmp_path,
        systems="member:smollm2-135m",
        members=["smollm2-135m"],
        limit=1,
        max_tokens=16,
        progress=False,
    )
    (record,) = read_records(path)
    assert record["id"] == "ifeval-1000" and len(record["inst_level_strict_acc"]) == 3
    assert set(record) >= {"prompt_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc"}


# --- the lm-evaluation-harness adapter ------------------------------------------


@pytest.mark.models
def test_lm_eval_model_is_registered_and_generates():
    from lm_eval.api.registry import get_model

    from segfuse.eval.lm_eval_adapter import SegfuseLM, task_manager

    assert get_model("segfuse") is SegfuseLM
    lm = SegfuseLM(models="smollm2-135m", system="member:smollm2-135m", max_tokens=12)

    class Request:  # lm-eval's Instance exposes its arguments as .args
        args = ("What is 2 + 3? Reply with the number only.", {"until": ["\n\n"], "max_gen_toks": 64})

    (text,) = lm.generate_until([Request()], disable_tqdm=True)
    assert "5" in text
    lm.ensemble.close()
    known = task_manager().all_tasks
    assert "segfuse_gsm8k" in known and "segfuse_bigbench_mc" in known


class _Request:  # lm-eval's Instance exposes its arguments as .args
    def __init__(self, *args: object) -> None:
        self.args = args


@pytest.mark.models
def test_lm_eval_bigbench_group_runs_offline_and_one_member_gives_its_own_scores():
    import lm_eval

    from segfuse.eval.bigbench import TASKS, items
    from segfuse.eval.lm_eval_adapter import SegfuseLM, task_manager

    # No prefix cache: every item is decoded on an empty cache, so scores do not depend on the order.
    lm = SegfuseLM(models="smollm2-135m", system="member:smollm2-135m", threads=1, prefix_cache_cells=0)
    try:
        out = lm_eval.simple_evaluate(
            model=lm, tasks=["segfuse_bigbench_mc"], task_manager=task_manager(), limit=1, log_samples=True
        )
        assert "acc,none" in out["results"]["segfuse_bigbench_mc"]
        for task in TASKS:
            name = "segfuse_bigbench_" + task.replace("-", "_")
            item = items(task, 0, 1)[0]
            own = lm.ensemble.score(item.context, list(item.choices), rule="loglinear-whole")
            (sample,) = out["samples"][name]
            answered = [resp[0][0] for resp in sample["resps"]]
            assert answered == pytest.approx([s.logprob for s in own.members["smollm2-135m"]], abs=2e-3)
            assert out["results"][name]["acc,none"] == float(own.best in item.correct)
    finally:
        lm.ensemble.close()


@pytest.mark.models
def test_lm_eval_loglikelihood_pools_the_members_by_the_rule():
    from segfuse.eval.lm_eval_adapter import SegfuseLM

    context, choices = "Q: What is the capital of France?\nA:", [" Paris", " Berlin", " a small potato"]
    requests = [_Request(context, c) for c in choices]
    lm = SegfuseLM(models="smollm2-135m|gemma3-270m", rule="mixture-byte", threads=1, prefix_cache_cells=0)
    try:
        own = lm.ensemble.score(context, choices, rule="loglinear-whole")
        rows = list(own.members.values())
        mixture = lm.loglikelihood(requests, disable_tqdm=True)
        assert sum(math.exp(v) for v, _ in mixture) == pytest.approx(1.0)
        assert [v for v, _ in mixture] == pytest.approx(own.pooled(Rule.parse("mixture-byte")), abs=1e-3)
        lm.scoring.rule = Rule.parse("loglinear-whole", {"smollm2-135m": 3, "gemma3-270m": 1})
        weighted = lm.loglikelihood(requests, disable_tqdm=True)
        assert [v for v, _ in weighted] == pytest.approx(
            [0.75 * a.logprob + 0.25 * b.logprob for a, b in zip(*rows)], abs=1e-3
        )
        assert [g for _, g in weighted] == [a.greedy and b.greedy for a, b in zip(*rows)]
        (rolling,) = lm.loglikelihood_rolling([_Request("The cat sat on the mat.")], disable_tqdm=True)
        texts = lm.ensemble.score("", ["The cat sat on the mat."], rule="loglinear-whole")
        assert rolling == pytest.approx(
            0.75 * texts.members["smollm2-135m"][0].logprob + 0.25 * texts.members["gemma3-270m"][0].logprob, abs=1e-3
        )
        with pytest.raises(InvalidRequestError, match="unknown rule"):
            SegfuseLM(models="smollm2-135m", rule="median")
        with pytest.raises(InvalidRequestError, match="bad weights"):
            SegfuseLM(models="smollm2-135m", weights="smollm2-135m=1")
    finally:
        lm.ensemble.close()


@pytest.mark.models
def test_lm_eval_cli_runs_a_local_task_with_the_segfuse_model():
    # lm-eval's own CLI (through our console script, which registers the model and the local tasks).
    args = "models=smollm2-135m,system=member:smollm2-135m,max_tokens=16,threads=1"
    done = run_lm_eval("segfuse-lm-eval", "segfuse", args, "segfuse_gsm8k", 1)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "|segfuse_gsm8k|" in done.stdout and "exact_match" in done.stdout


# --- selection study: screening systems and the report's loop columns ---------------


def test_fusion_systems_parse_options_and_refuse_bad_ones():
    from segfuse.eval.systems import get_system, parse_fusion

    assert parse_fusion("gate=0.7/guard=true/exit=false/prior=prompt/leader=qwen") == {
        "gate": 0.7,
        "guard": True,
        "exit": False,
        "prior": "prompt",
        "leader": "qwen",
    }
    assert parse_fusion("gate=none/window=6") == {"gate": None, "window": 6}
    get_system("fusion:gate=0.5/guard=true")  # resolves to a runnable system
    with pytest.raises(InvalidRequestError, match="bad fusion option"):
        parse_fusion("gates=0.5")
    with pytest.raises(InvalidRequestError, match="invalid option"):
        parse_fusion("gate=-1")
    assert resolve_systems("member:a,fusion:gate=0.8/guard=true", ["a"]) == ["member:a", "fusion:gate=0.8/guard=true"]


def test_report_counts_answers_at_the_limit_and_looping_answers():
    loop = "The total is 5 apples and 3 pears. " * 4

    def rec(i, system, ok, output, finish):
        return gsm8k_record(i, system, ok, output=output, finish_reason=finish)

    records = [
        rec(0, "member:a", True, "The answer is 8.", "stop"),
        rec(1, "member:a", False, loop, "length"),
        rec(0, "default", True, "The answer is 8.", "stop"),
        rec(1, "default", True, "So 8.", "stop"),
    ]
    rows, common = summarise(GSM8K, records)
    by = {r.system: r for r in rows}
    assert (by["member:a"].at_limit, by["member:a"].looping) == (0.5, 0.5)
    assert (by["default"].at_limit, by["default"].looping) == (0.0, 0.0)
    text = comparisons(GSM8K, rows, records, common)
    assert "| `default` | `member:a` | +50.0% | 1 | 0 | 1.000 |" in text  # every engine variant vs the best member


def test_scoring_pieces_are_bounded_in_bytes_not_characters():
    from segfuse.backends.likelihood import split_for_scoring

    text = "天气很好。" * 200 + " and some words at the end"
    pieces = split_for_scoring(text, limit=400)
    assert "".join(pieces) == text
    assert all(len(p.encode("utf-8")) <= 400 for p in pieces)  # at most 400 tokens in any vocabulary
