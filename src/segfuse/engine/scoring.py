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
from dataclasses import dataclass

from ..options import SCORE_MODES, FusionOptions, ScoreMode
from ..types import TokenScores


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


# --- Online feedback (SpecEM Hedge) ------------------------------------------------


def hedge_rewards(normalised: Sequence[Sequence[float]]) -> list[float]:
    """Win-rate reward of each member from the other members' eyes.

    ``normalised[j][i]`` is verifier j's normalised score of member i's draft
    (K x K, same member order on both axes). Reward of i = number of pairs
    (j, k) with j != i, k != i and S[j][i] >= S[j][k], over (K-1)^2, floored at
    1/(K-1)^2 (docs/design.md#hedge-online-feedback).
    """
    k = len(normalised)
    if k < 2:
        return [0.0] * k
    pairs = (k - 1) ** 2
    rewards = []
    for i in range(k):
        wins = sum(
            1
            for j in range(k)
            if j != i
            for other in range(k)
            if other != i and normalised[j][i] >= normalised[j][other]
        )
        rewards.append(max(wins, 1) / pairs)
    return rewards


def hedge_update(
    weights: Sequence[float], normalised: Sequence[Sequence[float]], round_index: int, eta0: float
) -> list[float]:
    """One multiplicative-weights step: w_i <- w_i * exp(eta_t * reward_i), renormalised.

    eta_t = eta0 * sqrt(1/K) / t with t the 1-based round index.
    """
    k = len(weights)
    if k < 2:
        return [1.0] * k
    eta = eta0 * math.sqrt(1.0 / k) / round_index
    updated = [w * math.exp(eta * r) for w, r in zip(weights, hedge_rewards(normalised))]
    total = sum(updated)
    return floor_weights([w / total for w in updated])


HEDGE_FLOOR = 1e-6  # the least share a member keeps: one the votes once disfavoured can still recover


def floor_weights(weights: Sequence[float], floor: float = HEDGE_FLOOR) -> list[float]:
    """Weights renormalised with every share at least `floor` (a weight that underflowed to 0, or was
    not a number, would never grow again under multiplicative updates)."""
    if all(math.isfinite(w) and w >= floor for w in weights):
        return list(weights)  # nothing to lift: the weights stay exactly as they are
    kept = [w if math.isfinite(w) and w > floor else floor for w in weights]
    total = sum(kept)
    return [w / total for w in kept]


# --- Model Exit ----------------------------------------------------------------------


def softmax(values: Sequence[float], temperature: float) -> list[float]:
    top = max(values)
    exps = [math.exp((v - top) / temperature) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def normalised_entropy(probs: Sequence[float]) -> float:
    """Entropy divided by its maximum log(K): 1 = undecided, 0 = one member has it all."""
    if len(probs) < 2:
        return 0.0
    h = -sum(p * math.log(p) for p in probs if p > 0.0)
    return h / math.log(len(probs))


@dataclass(frozen=True)
class ExitRule:
    """Model Exit's settings (the options' ``exit_*``): see :func:`model_exit`."""

    warmup: int
    entropy_threshold: float
    temperature: float
    fraction: float
    min_active: int

    @classmethod
    def of(cls, options: FusionOptions) -> ExitRule:
        return cls(
            options.exit_warmup,
            options.exit_entropy,
            options.exit_temperature,
            options.exit_fraction,
            options.exit_min_active,
        )


def model_exit(quality: Sequence[float], rounds_done: int, rule: ExitRule) -> list[int]:
    """Indices (into `quality`) of members that should stop drafting and verifying.

    ``quality[i]`` is member i's cumulative quality: the sum of its drafts'
    aggregate scores over the rounds so far. Rule: after ``warmup`` rounds,
    p = softmax(quality / temperature); once the ensemble has a clear view
    (normalised entropy of p below ``entropy_threshold``), members whose share
    p_i is below ``fraction`` / K stop, worst first, keeping at least
    ``min_active`` (never fewer than 1).
    """
    k = len(quality)
    keep = max(1, rule.min_active)
    if rounds_done < rule.warmup or k <= keep:
        return []
    probs = softmax(quality, rule.temperature)
    if normalised_entropy(probs) >= rule.entropy_threshold:
        return []
    laggards = sorted((p, i) for i, p in enumerate(probs) if p < rule.fraction / k)
    return [i for _, i in laggards[: k - keep]]


def exit_reason(quality: Sequence[float], index: int, temperature: float) -> str:
    """Human-readable why of an exit decision, for the round record."""
    probs = softmax(quality, temperature)
    return (
        f"share {probs[index]:.3f} of cumulative quality among {len(quality)} active "
        f"(normalised entropy {normalised_entropy(probs):.3f})"
    )
