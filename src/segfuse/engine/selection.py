"""Pure functions that keep weak members from hijacking the answer
(docs/design.md#selection-that-weak-members-cannot-hijack).

- Degeneration guard: a candidate that repeats the answer's own recent text
  (the likelihood trap: fluent loops score high under mean probability) may
  not win while a non-repeating candidate is available.
- Cross-votes: a member's quality for Model Exit counts only the *other*
  members' votes on its drafts, so no member stays in by praising itself.
- Prompt-fit weights (PackLLM-sim): per query, how well each member predicts
  the prompt, in bits per byte so that tokenizers are comparable, turned into
  voting weights by a softmax over negative bits per byte.
- Confidence gate (GaC-style thresholding): the leader's draft is accepted
  without a round when its own mean token probability reaches a threshold.
- The leader verifies (speculative decoding's reading of a round,
  docs/design.md#the-leader-gate-and-acceptance-margin):
  when it is unsure, another member's segment may win only if the leader
  accepts it (:func:`leader_accepts`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..types import TokenScores
from .scoring import softmax

_WORD = re.compile(r"\S+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def loops(text: str, n: int = 8, times: int = 3) -> bool:
    """Whether some word n-gram occurs at least `times` times: the answer went round in a loop."""
    words = _words(text)
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - n + 1):
        gram = tuple(words[i : i + n])
        counts[gram] = counts.get(gram, 0) + 1
        if counts[gram] >= times:
            return True
    return False


def repeat_share(answer: str, text: str, n: int = 6, times: int = 1) -> float:
    """Share of the word n-grams that `text` completes which occur `times` times or more in `answer`.

    The n-grams are taken over ``answer + text`` and counted when they end in
    `text`'s words, so a segment continuing a phrase is judged with its context.
    0.0 when `text` completes no n-gram (too short to tell).
    """
    before = _words(answer)
    words = before + _words(text)
    first_new = len(before)
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(before) - n + 1):
        gram = tuple(before[i : i + n])
        counts[gram] = counts.get(gram, 0) + 1
    ends = range(max(n, first_new + 1), len(words) + 1)
    grams = [tuple(words[end - n : end]) for end in ends]
    if not grams:
        return 0.0
    return sum(1 for g in grams if counts.get(g, 0) >= times) / len(grams)


MIN_WORDS = 3  # a candidate shorter than this is too little text to penalise


def degeneration(
    answer: str, text: str, last: str = "", *, n: int = 6, times: int = 2, share: float = 0.75
) -> str | None:
    """Why `text` would make the answer loop, or None if it does not.

    Restating a phrase once is normal (math and instructions reuse names and
    units), so only a loop counts: the candidate repeats the `last` accepted
    segment word for word (a stutter), or at least `share` of the word n-grams
    it completes have already occurred `times` times (the answer is entering
    another lap). Candidates of fewer than ``MIN_WORDS`` words are not judged:
    too little text to penalise on (see :func:`continues_loop` for counting them).
    """
    stripped = text.strip()
    if len(_words(stripped)) < MIN_WORDS:
        return None
    if last and stripped == last.strip():
        return "repeats the last segment"
    value = repeat_share(answer, text, n, times)
    if value >= share:
        return f"{value:.0%} of its {n}-grams already seen {times}+ times"
    return None


def continues_loop(answer: str, text: str, *, n: int = 6, times: int = 2, share: float = 0.75) -> bool:
    """Whether accepting `text`, however short, keeps the answer in a loop (the n-gram rule alone)."""
    return bool(_words(text)) and repeat_share(answer, text, n, times) >= share


def guard_eligible(eligible: Sequence[bool], penalised: Sequence[bool]) -> list[bool]:
    """Candidates allowed to win: eligible and not penalised, unless that leaves none.

    When every eligible candidate degenerates the guard steps aside (the round
    must still produce text), and the ordinary ranking decides.
    """
    kept = [e and not p for e, p in zip(eligible, penalised)]
    return kept if any(kept) else list(eligible)


def cross_quality(normalised: Sequence[Sequence[float]], weights: Sequence[float], index: int) -> float:
    """Candidate `index`'s score from every verifier but its own author.

    ``normalised[j][i]`` is verifier j's normalised score of member i's draft
    (same member order on both axes). The weighted mean over j != index, so
    the value is comparable whatever the number of voters; 0.0 with no voter.
    """
    pairs = [(w, row[index]) for j, (w, row) in enumerate(zip(weights, normalised)) if j != index]
    total = sum(w for w, _ in pairs)
    if total <= 0.0:
        return sum(v for _, v in pairs) / len(pairs) if pairs else 0.0
    return sum(w * v for w, v in pairs) / total


def bits_per_byte(logprob_sum: float, n_bytes: int) -> float:
    """Negative log-likelihood in bits per UTF-8 byte (natural-log input)."""
    if n_bytes <= 0:
        raise ValueError("bits per byte needs at least one byte")
    return -logprob_sum / (math.log(2.0) * n_bytes)


def prompt_weights(bpb: Sequence[float], temperature: float) -> list[float]:
    """PackLLM-sim weights: softmax(-bpb / temperature). Lower bits per byte, more weight."""
    if not bpb:
        return []
    if temperature <= 0.0:
        raise ValueError("temperature must be positive")
    return softmax([-b for b in bpb], temperature)


def pick_leader(weights: Sequence[float]) -> int:
    """Index of the heaviest member; ties go to the earliest listed."""
    if not weights:
        raise ValueError("no members")
    return max(range(len(weights)), key=lambda i: (weights[i], -i))


def mean_probability(logprobs: Sequence[float]) -> float:
    """Mean per-token probability of a draft under its own author."""
    if not logprobs:
        return 0.0
    return sum(math.exp(lp) for lp in logprobs) / len(logprobs)


def gate_passes(confidence: float, threshold: float) -> bool:
    """The leader goes alone when its confidence reaches the threshold (inclusive).

    A threshold above 1 never passes: every round is a full round.
    """
    return confidence >= threshold


@dataclass(frozen=True)
class Verdict:
    """The leader's answer to one proposal, and why."""

    accepted: bool
    reason: str


def leader_accepts(proposal: TokenScores, own: TokenScores | None, rule: str, margin: float) -> Verdict:
    """Whether the leader accepts another member's segment (`proposal`: the leader's scores of it).

    - ``worst``: every token of the segment is within `margin` nats of the
      leader's own most likely token at that position (the leader would
      nearly have written each of them). With margin 0 only the leader's own
      greedy choices pass, as in speculative decoding's greedy acceptance.
    - ``mean``: the leader's mean log-probability of the segment is within
      `margin` nats of its mean log-probability of its own draft (`own`).
    """
    if rule == "worst":
        if proposal.tops is None:
            return Verdict(False, "rejected: the leader reports no top choices to compare with")
        worst = max(top - lp for lp, top in zip(proposal.logprobs, proposal.tops))
        if worst <= margin:
            return Verdict(True, f"accepted: every token within {worst:.2f} nats of the leader's choice")
        return Verdict(False, f"rejected: a token {worst:.2f} nats below the leader's choice (margin {margin:g})")
    if rule == "mean":
        if own is None or not own.logprobs or not proposal.logprobs:
            return Verdict(False, "rejected: the leader's own draft has no score to compare with")
        gap = sum(own.logprobs) / len(own.logprobs) - sum(proposal.logprobs) / len(proposal.logprobs)
        verdict = "accepted" if gap <= margin else "rejected"
        return Verdict(
            gap <= margin,
            f"{verdict}: mean log-probability {gap:.2f} nats below the leader's draft (margin {margin:g})",
        )
    raise ValueError(f"unknown acceptance rule {rule!r}")
