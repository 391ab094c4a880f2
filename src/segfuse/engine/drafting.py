"""Drafting for the leader: who drafts this round, and for how many tokens (docs/performance.md#drafting).

With ``FusionOptions.draft`` on, the leader still writes the whole answer, but it may read drafts:
texts that other members wrote (``members``) or that repeat the prompt or the answer so far
(``lookup``: no model at all). It reads them in one pass and keeps what it would have written itself
(``backends/speculation.py``), so the answer is the leader's own, token for token, and a round may
keep many tokens for the price of a little more than one.

Whether that pays depends on how often the leader agrees with a drafter and on what drafting and
reading cost on this machine. :class:`DraftPlanner` measures both as the answer grows, per drafter:

- each drafter's acceptance (tokens kept per token proposed, as a rate per token), and its drafting
  time per token;
- the leader's own time per token when it writes alone, and how much more one pass costs per token read.

Each round it sets each drafter's draft length (longer after a draft was kept whole, shorter after
one was not, as assisted generation's heuristic schedule does), and with ``auto`` it asks only the
drafters whose expected tokens per second beat the leader alone; a drafter that does not pay is
benched (Model Exit for drafters) and tried again much later; when none pays the leader writes the
round alone, as with ``off``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..options import FusionOptions

LOOKUP = "lookup"  # the drafter that copies text: no model

# Before anything is measured: what one more token read in a pass costs, as a share of one token
# written alone (llama.cpp on a 2-core CPU, logits at every position: 8 tokens 4.1-5.5x one), and the
# acceptance a drafter starts with. A pass that reads a copy measures the first for the machine at hand.
PRIOR_READ_COST = 0.5
PRIOR_ACCEPTANCE = 0.5
PRIOR_LOOKUP_ACCEPTANCE = 0.6  # a copied draft follows words the answer just repeated: likelier kept
UNKNOWN_SIZE = 0.5  # a drafter's size over the leader's, where either is unknown
BENCHED_ROUNDS = 24  # rounds a drafter that does not pay sits out before it is tried again (auto)
MARGIN = 1.03  # a plan must beat the leader alone by this much (auto): noise must not make it slower
# A drafter's draft ends after a token it gives less than this (assisted generation's default confidence
# threshold): the leader seldom keeps what follows, and every token read costs it.
DRAFT_STOP_BELOW = 0.4
LOOKUP_NGRAMS = (8, 6, 4, 3)  # pieces of the answer's end that a copied draft must follow, longest first
_PIECE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


def lookup_draft(source: str, answer: str, max_chars: int) -> str:
    """Text that followed the answer's last words where they appeared before, in `source` (the prompt) or
    earlier in the answer: prompt lookup decoding, on text. "" where nothing matches."""
    if not answer or max_chars <= 0:
        return ""
    pieces = _PIECE.findall(answer[-512:])
    haystack = source + "\n" + answer
    for n in LOOKUP_NGRAMS:
        if len(pieces) < n:
            continue
        suffix = "".join(pieces[-n:])
        at = haystack.rfind(suffix, 0, len(haystack) - 1)
        if at >= 0:
            start = at + len(suffix)
            draft = haystack[start : start + max_chars]
            if draft:
                return draft
    return ""


@dataclass
class Drafter:
    """What one drafter has shown in this answer."""

    name: str
    length: int  # its next draft's length, in tokens
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    misses: int = 0  # rounds in which the leader kept less than the whole draft
    seconds_per_token: float | None = None  # drafting time (None: not measured; 0 for lookup)
    benched_until: int = 0  # (auto) not asked before this round
    prior: float = PRIOR_ACCEPTANCE
    expected_s: float = 0.0  # (auto) its time per token until measured

    @property
    def acceptance(self) -> float:
        """The chance that the leader keeps the next token of its draft (a smoothed estimate)."""
        return (self.accepted + 2 * self.prior) / (self.accepted + self.misses + 2)

    def bench(self, until: int) -> None:
        """Not asked before round `until`; then tried again, its evidence so far weighing half."""
        self.benched_until, self.rounds = until, 0
        self.accepted, self.misses = self.accepted // 2, self.misses // 2

    def learn(self, accepted: int, proposed: int, draft_seconds: float | None, max_length: int) -> None:
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        whole = proposed > 0 and accepted >= proposed
        self.misses += 0 if whole else 1
        # The heuristic schedule: longer after a draft kept whole, shorter after one that was not.
        self.length = min(max_length, self.length + 2) if whole else max(1, self.length - 1)
        if draft_seconds is not None and proposed > 0:
            per_token = draft_seconds / proposed
            old = self.seconds_per_token
            self.seconds_per_token = per_token if old is None else 0.7 * old + 0.3 * per_token


def expected_tokens(acceptance: float, length: int) -> float:
    """Tokens a round keeps on average with a draft of `length` tokens (the leader's own token included)."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (length + 1)) / (1 - a)


@dataclass
class Plan:
    """A round's drafting: each asked drafter's draft length (empty: the leader writes alone)."""

    lengths: dict[str, int] = field(default_factory=dict)

    @property
    def drafting(self) -> bool:
        return bool(self.lengths)


class DraftPlanner:
    """Per answer: who drafts each round and for how long, from what the answer has measured so far."""

    def __init__(self, options: FusionOptions, members: list[str]) -> None:
        self.mode = options.draft
        self.max_length = options.draft_max
        names = ([LOOKUP] if self.mode in ("lookup", "auto") else []) + (
            members if self.mode in ("members", "auto") else []
        )
        # Auto probes cheaply: a short first copy costs little when it is wrong, and the schedule lengthens it
        # as long as the copy holds. A model's draft starts at the longest: it ends by itself where the drafter
        # grows unsure (DRAFT_STOP_BELOW), as assisted generation's do.
        first_copy = 3 if self.mode == "auto" else 6
        self.drafters = {
            n: Drafter(n, min(first_copy, self.max_length) if n == LOOKUP else self.max_length) for n in names
        }
        if LOOKUP in self.drafters:
            self.drafters[LOOKUP].seconds_per_token, self.drafters[LOOKUP].prior = 0.0, PRIOR_LOOKUP_ACCEPTANCE
        self.alone_s: float | None = None  # the leader's time per token writing alone
        self.read_cost = PRIOR_READ_COST  # one more token read in a pass, as a share of alone_s
        self.rounds = 0

    # --- deciding -------------------------------------------------------------------------
    def plan(self, round_no: int, lookup_ready: bool, members: dict[str, float | None]) -> Plan:
        """This round's drafters; `lookup_ready`: the lookup found text to copy; `members`: the drafters
        that can draft now (active), each with its size over the leader's where known (until a drafter's
        speed is measured, auto expects its time per token in that ratio to the leader's)."""
        ready = [n for n in self.drafters if (n == LOOKUP and lookup_ready) or (n != LOOKUP and n in members)]
        if self.mode != "auto":
            return Plan({n: self.drafters[n].length for n in ready})
        if self.alone_s is None:  # first rounds alone: they measure the leader (and stream at once)
            return Plan()
        paying: dict[str, tuple[int, float]] = {}
        for name in ready:
            drafter = self.drafters[name]
            if round_no < drafter.benched_until:
                continue
            if drafter.seconds_per_token is None:  # not measured yet: in proportion to its size
                ratio = members.get(name)
                drafter.expected_s = (UNKNOWN_SIZE if ratio is None else ratio) * self.alone_s
            # Whether it pays at its best length; asked at the schedule's length, which follows streaks
            # (a copy that goes on, a drafter in step) that a constant acceptance cannot see.
            _, gain = self.best_length(drafter)
            if gain >= MARGIN:
                paying[name] = (drafter.length, gain)
            elif drafter.rounds:  # it was tried and does not pay: it sits out a while, then may try again
                drafter.bench(round_no + BENCHED_ROUNDS)
        # Lookup costs nothing to draft: it joins whenever it pays on its own. Of the drafters with models,
        # only the one that pays best (each costs its drafting time).
        chosen: dict[str, int] = {}
        if LOOKUP in paying:
            chosen[LOOKUP] = paying.pop(LOOKUP)[0]
        if paying:
            best = max(paying, key=lambda n: paying[n][1])
            chosen[best] = paying[best][0]
        return Plan(chosen)

    def best_length(self, drafter: Drafter) -> tuple[int, float]:
        """The draft length with the most tokens per second, and its speed over the leader alone."""
        alone = self.alone_s or 1.0
        per_token = drafter.seconds_per_token if drafter.seconds_per_token is not None else drafter.expected_s
        best = (1, 0.0)
        for length in range(1, self.max_length + 1):
            cost = per_token * length + alone * (1 + self.read_cost * length)
            gain = expected_tokens(drafter.acceptance, length) * alone / cost
            if gain > best[1]:
                best = (length, gain)
        return best

    # --- learning -------------------------------------------------------------------------
    def learned_alone(self, seconds: float, tokens: int) -> None:
        """The leader wrote a round alone: `tokens` in `seconds`."""
        if tokens <= 0:
            return
        per_token = seconds / tokens
        self.alone_s = per_token if self.alone_s is None else 0.7 * self.alone_s + 0.3 * per_token

    def learned_read(self, seconds: float, tokens_read: int) -> None:
        """The leader read `tokens_read` draft tokens (beyond its own) in one pass of `seconds`."""
        if self.alone_s is None or tokens_read <= 0:
            return
        observed = max(0.0, (seconds / self.alone_s - 1) / tokens_read)
        self.read_cost = 0.7 * self.read_cost + 0.3 * observed

    def learned_draft(self, name: str, accepted: int, proposed: int, seconds: float | None) -> None:
        self.drafters[name].learn(accepted, proposed, seconds, self.max_length)
