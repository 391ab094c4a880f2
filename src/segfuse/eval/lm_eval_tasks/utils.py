"""Scoring hooks of the local lm-eval task configs: the same rules as `segfuse eval`."""

from typing import Any

from segfuse.eval.nltk_offline import ensure_punkt
from segfuse.eval.tasks import extract_number, gsm8k_reference

ensure_punkt()  # lm-eval's IFEval module downloads punkt_tab at import when it is missing

from lm_eval.tasks.ifeval.utils import agg_inst_level_acc, process_results  # noqa: E402  # after ensure_punkt()


def process_gsm8k(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """Exact match of the final number (rule: segfuse.eval.tasks.extract_number)."""
    predicted = extract_number(results[0])
    correct = predicted is not None and abs(predicted - gsm8k_reference(doc["answer"])) < 1e-6
    return {"exact_match": float(correct)}


def process_ifeval(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """lm-eval's IFEval scoring; our data file has the same fields as google/IFEval."""
    scores: dict[str, Any] = process_results(doc, results)
    return scores


__all__ = ["agg_inst_level_acc", "process_gsm8k", "process_ifeval"]
