"""A round in which the leader reads drafts (``FusionOptions.draft``; the plan is ``drafting.py``).

The drafters asked this round propose texts (members draft greedily from their own contexts, which
hold the answer so far; the lookup copies text), the leader reads them all in one call
(``MemberSession.speculate``) and keeps what it would have written; its kept tokens are the round's
segment, broadcast as any winner's. What each drafter proposed and the leader kept teaches the planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..segments import complete_utf8_prefix
from ..types import DraftTokens, Message, Speculation
from .calls import Asking
from .context import GenerationContext, Round
from .crowd import in_flight
from .drafting import DRAFT_STOP_BELOW, LOOKUP, DraftPlanner, Plan, lookup_draft
from .phases import Draft, Drafted, cut_segment, stops
from .records import Decision
from .seats import Seat, Seats

CHARS_PER_TOKEN = 4  # how much copied text a lookup draft of n tokens takes (the leader cuts it to tokens)


def draft_text(tokens: DraftTokens) -> str:
    """A drafter's tokens as text: whole characters, without its end token, up to the first bytes that are
    not UTF-8 (byte tokens a drafter strung together wrongly: the leader reads text only)."""
    data = b"".join(tokens.pieces)
    data = data[: complete_utf8_prefix(data)]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as bad:
        return data[: bad.start].decode("utf-8")


def prompt_text(messages: Sequence[Message]) -> str:
    """What the lookup copies from besides the answer: every message of the conversation."""
    return "\n".join(m.content for m in messages)


class DraftedRounds:
    """One generation's drafting: its planner, and the rounds in which the leader reads drafts."""

    def __init__(self, context: GenerationContext, messages: Sequence[Message], members: list[str]) -> None:
        self.context = context
        self.source = prompt_text(messages)
        self.planner = DraftPlanner(context.options, members)
        self.tally: dict[str, dict[str, int]] = {}  # drafter -> rounds, tokens proposed, tokens kept
        self.last: dict[str, list[int]] = {}  # the last drafted round's: drafter -> [proposed, kept]
        self.crowded = False  # this round: too many answers in flight to draft (its time is not the leader's own)
        self.crowded_rounds = 0

    def plan(self, seats: Seats, leader: Seat, at: Round) -> tuple[Plan, str]:
        """This round's drafters and the lookup's text (where the lookup may draft); none while more answers
        are in flight together than the options allow drafting for."""
        self.crowded = in_flight() > self.context.options.draft_users
        if self.crowded:
            self.crowded_rounds += 1
            return Plan(), ""
        copied = ""
        if LOOKUP in self.planner.drafters:
            length = self.planner.drafters[LOOKUP].length
            copied = lookup_draft(self.source, at.message, length * CHARS_PER_TOKEN)
        size = leader.member.n_params
        members = {
            s.name: s.member.n_params / size if s.member.n_params and size else None
            for s in seats.active
            if s is not leader and self.context.drafts(s.member)
        }
        return self.planner.plan(at.no, bool(copied), members), copied

    def round(self, seats: Seats, leader: Seat, at: Round, plan: Plan, copied: str) -> Asking:
        """The drafters draft, the leader reads: [(leader, its segment)], or [] when the leader's call failed."""
        context = self.context
        drafters = [s for s in seats.active if s is not leader and s.name in plan.lengths]
        greedy = replace(context.sampling, temperature=0.0, top_logprobs=0, stop_below=DRAFT_STOP_BELOW)
        outcomes = yield from seats.ask(drafters, "draft", "draft", lambda s: (plan.lengths[s.name], greedy))
        proposals = [(LOOKUP, copied)] if LOOKUP in plan.lengths and copied else []
        proposals += [(seat.name, draft_text(t)) for seat, t in seats.survivors(drafters, outcomes, at.no, "draft")]
        limit = min(at.budget, max(plan.lengths.values(), default=0) + 1)
        texts = [text for _, text in proposals]
        asked = yield from seats.ask([leader], "draft", "speculate", lambda s: (texts, limit, context.sampling))
        answered = seats.survivors([leader], asked, at.no, "draft")
        if not answered:
            return []
        read: Speculation = answered[0][1]
        self._learn(seats, leader, proposals, read)
        draft = cut_segment(leader.name, read.tokens, at.message, stops(leader, context), whole_words=False)
        draft = replace(draft, own_scores=None, rejected=context.check(at.message, draft.candidate))
        return [(leader, draft)]

    def learned(self, decision: Decision, at: Round) -> dict[str, list[int]]:
        """What a decided round teaches (a round the leader wrote alone: its time per token, but not the
        first, whose time is mostly the prompt's); the drafts of the round, when it was a drafted one:
        drafter -> [proposed, kept]."""
        if decision.how == "drafted":
            return self.last
        if len(decision.drafted) == 1 and at.no > 1 and not self.crowded:  # the leader alone wrote it
            self._learned_alone(decision.drafted[0][0], decision.drafted, at.budget)
        return {}

    def _learned_alone(self, leader: Seat, drafted: Drafted, budget: int) -> None:
        draft: Draft | None = next((d for s, d in drafted if s is leader), None)
        if draft is None:
            return
        written = draft.candidate.n_tokens + (1 if draft.candidate.finished else 0)
        tokens = written if draft.candidate.finished else min(self.context.options.window, budget)
        self.planner.learned_alone(leader.timings.get("draft", 0.0), tokens)

    def _learn(self, seats: Seats, leader: Seat, proposals: list[tuple[str, str]], read: Speculation) -> None:
        by_name = {s.name: s for s in seats.all}
        self.last = {}
        for (name, _), kept, proposed in zip(proposals, read.accepted, read.proposed):
            seconds = None if name == LOOKUP else by_name[name].timings.get("draft")
            self.planner.learned_draft(name, kept, proposed, seconds)
            self.last[name] = [proposed, kept]
            tally = self.tally.setdefault(name, {"rounds": 0, "proposed": 0, "kept": 0})
            tally["rounds"] += 1
            tally["proposed"] += proposed
            tally["kept"] += kept
        self.planner.learned_read(leader.timings.get("draft", 0.0), sum(read.proposed))
