"""lm-eval's log-likelihood requests answered by the ensemble's members (the adapter's scoring half).

Requests that share a context (the choices of one multiple-choice item) are scored together: one
cached context per member, every choice on it, pooled by the rule. Items go to the members
``batch`` at a time (default: the most slots a member holds), so that a member loaded with
``slots=N`` scores N items' choices in one decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..backends.base import Member
from ..errors import InvalidRequestError
from ..likelihood import ItemScores, Rule, score_items, weight_pairs

if TYPE_CHECKING:
    from ..ensemble import Ensemble

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
    """Which members score, the rule that pools them, and how many items go to them at once."""

    members: list[Member]
    rule: Rule
    batch: int = 1

    @classmethod
    def build(cls, ensemble: Ensemble, system: str, rule: Rule) -> LikelihoodScoring:
        """`system` ``member:NAME`` scores with that member alone; any other, with every member."""
        picked = ensemble.pick([system.split(":", 1)[1]] if system.startswith("member:") else None)
        rule.member_weights([m.name for m in picked])  # refuse bad weights before any request
        return cls(picked, rule, max((m.slots or 1 for m in picked), default=1))

    def loglikelihood(self, args: Sequence[tuple[str, str]], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        groups: dict[str, list[int]] = {}
        for i, (context, _) in enumerate(args):
            groups.setdefault(context, []).append(i)
        items = [(context, list(dict.fromkeys(args[i][1] for i in indices))) for context, indices in groups.items()]
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(args)
        with tqdm(total=len(items), disable=disable_tqdm, desc="segfuse loglikelihood") as bar:
            for at in range(0, len(items), self.batch):
                chunk = items[at : at + self.batch]
                for (context, choices), scored in zip(chunk, score_items(self.members, chunk, self.rule)):
                    _answer(args, groups[context], choices, _raised(scored), answers)
                bar.update(len(chunk))
        return answers

    def rolling(self, texts: Sequence[str], disable_tqdm: bool = True) -> list[float]:
        """Each text's log-linear pool of the members' summed log-probabilities, after a newline."""
        from tqdm import tqdm

        rule = Rule("loglinear", "whole", self.rule.weights)
        answers: list[float] = []
        for at in tqdm(range(0, len(texts), self.batch), disable=disable_tqdm, desc="segfuse loglikelihood_rolling"):
            chunk = [("", [text]) for text in texts[at : at + self.batch]]
            answers += [float(_raised(scored).fused[0]) for scored in score_items(self.members, chunk, rule)]
        return answers


def _raised(scored: ItemScores | Exception) -> ItemScores:
    """An item's scores; lm-eval takes no partial answers, so an item's error stops the run."""
    if isinstance(scored, Exception):
        raise scored
    return scored


def _answer(
    args: Sequence[tuple[str, str]],
    indices: list[int],
    choices: list[str],
    scored: ItemScores,
    answers: list[tuple[float, bool]],
) -> None:
    """Each request of one item: the pooled score of its continuation, and whether every member's greedy."""
    for i in indices:
        at = choices.index(args[i][1])
        greedy = all(bool(row[at].greedy) for row in scored.members.values())
        answers[i] = (float(scored.fused[at]), greedy)
