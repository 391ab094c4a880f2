"""lm-eval's log-likelihood requests answered by the ensemble's members (the adapter's scoring half).

Requests that share a context (the choices of one multiple-choice item) are scored together: one
cached context per member, every choice on it, pooled by the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..backends.base import Member
from ..errors import InvalidRequestError
from ..likelihood import Rule, score_item, weight_pairs

RULE_NAMES = ("loglinear", "mixture-byte", "mixture-whole")


def parse_weights(text: str | None) -> dict[str, float] | None:
    """``NAME:W|NAME:W`` as a mapping (None: uniform)."""
    if not text:
        return None
    return weight_pairs(str(text).split("|"), ":", "weights", "write NAME:WEIGHT|NAME:WEIGHT")


def parse_rule(rule: str, weights: str | None) -> Rule:
    """The adapter's ``rule`` and ``weights`` model_args as a rule. lm-eval's acc and acc_norm choose
    the unit of a log-linear pool, so its answer is the whole sum."""
    name = rule.strip().lower()
    if name not in RULE_NAMES and name not in ("loglinear-byte", "loglinear-whole"):
        raise InvalidRequestError(f"unknown rule {rule!r}", f"choose one of {', '.join(RULE_NAMES)}")
    return Rule.parse("loglinear-whole" if name.startswith("loglinear") else name, parse_weights(weights))


@dataclass
class LikelihoodScoring:
    """Which members score, and the rule that pools them."""

    members: list[Member]
    rule: Rule

    @classmethod
    def build(cls, ensemble, system: str, rule: Rule) -> LikelihoodScoring:
        """`system` ``member:NAME`` scores with that member alone; any other, with every member."""
        picked = ensemble.pick([system.split(":", 1)[1]] if system.startswith("member:") else None)
        rule.member_weights([m.name for m in picked])  # refuse bad weights before any request
        return cls(picked, rule)

    def loglikelihood(self, args: Sequence[tuple[str, str]], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        groups: dict[str, list[int]] = {}
        for i, (context, _) in enumerate(args):
            groups.setdefault(context, []).append(i)
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(args)
        for context, indices in tqdm(groups.items(), disable=disable_tqdm, desc="specfuse loglikelihood"):
            choices = list(dict.fromkeys(args[i][1] for i in indices))
            scored = score_item(self.members, context, choices, self.rule)
            for i in indices:
                at = choices.index(args[i][1])
                greedy = all(bool(row[at].greedy) for row in scored.members.values())
                answers[i] = (float(scored.fused[at]), greedy)
        return answers

    def rolling(self, texts: Sequence[str], disable_tqdm: bool = True) -> list[float]:
        """Each text's log-linear pool of the members' summed log-probabilities, after a newline."""
        from tqdm import tqdm

        rule = Rule("loglinear", "whole", self.rule.weights)
        return [float(score_item(self.members, "", [text], rule).fused[0])
                for text in tqdm(texts, disable=disable_tqdm, desc="specfuse loglikelihood_rolling")]
