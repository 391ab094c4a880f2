"""Pure functions that turn verifiers' token scores into a winner.

Score modes (a verifier's raw score r for one candidate):
- ``mean_prob``: mean per-token probability (the paper's text). Normalised
  across candidates as r / sum(r).
- ``mean_logprob``: mean per-token log-probability. Proportional normalisation
  is meaningless for negative numbers, so it is normalised by softmax, which
  equals proportional normalisation of the geometric-mean probability.
- ``mean_logit``: mean raw logit of the candidate's tokens (the reference
  code). Logits have no fixed sign, so it is normalised by softmax too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from .types import TokenScores

ScoreMode = Literal["mean_prob", "mean_logprob", "mean_logit"]
SCORE_MODES: tuple[str, ...] = ("mean_prob", "mean_logprob", "mean_logit")


def raw_score(scores: TokenScores, mode: ScoreMode) -> float:
    """One verifier's raw score of one candidate."""
    if not scores.logprobs:
        raise ValueError("cannot score a candidate without tokens")
    if mode == "mean_prob":
        values = [math.exp(lp) for lp in scores.logprobs]
    elif mode == "mean_logprob":
        values = list(scores.logprobs)
    elif mode == "mean_logit":
        values = list(scores.logits)
    else:
        raise ValueError(f"unknown score mode {mode!r}; choose one of {', '.join(SCORE_MODES)}")
    return sum(values) / len(values)


def normalise(raw: Sequence[float | None], mode: ScoreMode) -> list[float]:
    """Normalise one verifier's raw scores across candidates to sum to 1.

    ``None`` marks a candidate this verifier does not score (for example its
    own draft when self-scores are off); it gets 0 and the rest share the mass.
    """
    present = [r for r in raw if r is not None]
    if not present:
        return [0.0 for _ in raw]
    if mode == "mean_prob":
        total = sum(present)
        if total <= 0.0:
            share = 1.0 / len(present)
            return [share if r is not None else 0.0 for r in raw]
        return [r / total if r is not None else 0.0 for r in raw]
    top = max(present)
    exps = [math.exp(r - top) if r is not None else 0.0 for r in raw]
    total = sum(exps)
    return [e / total for e in exps]


def aggregate(normalised: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """score(i) = sum_j w_j * S[j][i] over verifiers j."""
    if len(normalised) != len(weights):
        raise ValueError("one weight per verifier is required")
    n = len(normalised[0]) if normalised else 0
    return [sum(w * row[i] for w, row in zip(weights, normalised)) for i in range(n)]


def pick_winner(totals: Sequence[float], eligible: Sequence[bool] | None = None) -> int:
    """Index of the best total; ties go to the lowest index (reproducible runs)."""
    best = -1
    for i, value in enumerate(totals):
        if eligible is not None and not eligible[i]:
            continue
        if best < 0 or value > totals[best]:
            best = i
    if best < 0:
        raise ValueError("no eligible candidate")
    return best
