"""The public Python API: an Ensemble of loaded members."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .backends.base import Member
from .backends.registry import load_member
from .engine import fuse, fusion_steps
from .errors import InvalidRequestError
from .models import DEFAULT_MODELS
from .options import FusionOptions
from .prompting import validate_messages
from .types import DoneEvent, Event, Message, Result

MAX_MEMBERS = 7
MAX_CONCURRENT = 32  # sessions a member without slots (remote, transformers) is asked to hold

Conversation = str | Sequence[Message | Mapping[str, str]]


def to_messages(prompt: Conversation) -> list[Message]:
    """A prompt string or a list of messages (dicts or Message) -> validated messages."""
    if isinstance(prompt, str):
        messages = [Message("user", prompt)]
    else:
        messages = []
        for item in prompt:
            if isinstance(item, Message):
                messages.append(item)
                continue
            role, content = item.get("role"), item.get("content")
            if role not in ("system", "user", "assistant") or not isinstance(content, str):
                raise InvalidRequestError(
                    f"bad message {dict(item)!r}",
                    "each message needs role system/user/assistant and string content",
                )
            messages.append(Message(role, content))
    validate_messages(messages)
    return messages


class Ensemble:
    """Several members answering together, one verified segment at a time.

    >>> with Ensemble() as ens:                       # the embedded default models
    ...     print(ens.generate("Name three primary colors.", max_tokens=48).text)
    """

    def __init__(self, members: Sequence[str | Member] | None = None, **member_options: Any) -> None:
        specs = list(members) if members else list(DEFAULT_MODELS)
        if len(specs) > MAX_MEMBERS:
            raise InvalidRequestError(f"{len(specs)} members given", f"use at most {MAX_MEMBERS}")
        self.members: list[Member] = []
        try:
            for spec in specs:
                self.members.append(spec if not isinstance(spec, str) else load_member(spec, **member_options))
        except BaseException:
            self.close()
            raise
        _make_names_unique(self.members)
        self.hedge_weights: dict[str, float] = {}  # carried across queries with hedge_persist

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]

    def stream(self, prompt: Conversation, **options: Any) -> Iterator[Event]:
        """Yield SegmentEvent / RoundEvent as they happen, then a DoneEvent."""
        opts = options.pop("options", None) or FusionOptions.build(**options)
        messages = to_messages(prompt)
        if not (opts.hedge and opts.hedge_persist):
            return fuse(self.members, messages, opts)
        return self._stream_persisting(messages, opts)

    def _stream_persisting(self, messages: list[Message], opts: FusionOptions) -> Iterator[Event]:
        # Hedge weights learned on one query become the next query's prior. They
        # live on this Ensemble object (in memory), see `hedge_weights`.
        for event in fuse(self.members, messages, opts, weights=self.hedge_weights or None):
            if isinstance(event, DoneEvent):
                self.hedge_weights = dict(event.result.weights)
            yield event

    @property
    def slots(self) -> int:
        """How many generations the members can hold at once (llama.cpp members are loaded with ``slots``)."""
        return min((int(getattr(m, "slots", MAX_CONCURRENT)) for m in self.members), default=1)

    def generate_many(self, prompts: Sequence[Conversation], *, max_concurrent: int | None = None,
                      **options: Any) -> list[Result]:
        """Answer several prompts at once, batching the members' work across them.

        Up to `max_concurrent` (default: every slot the members have; load with
        ``Ensemble(..., slots=N)``) run together; the rest wait their turn.
        Results come in the order of `prompts`; the first failure is raised
        once every prompt has run.
        """
        from .scheduler import run_all

        opts = options.pop("options", None) or FusionOptions.build(**options)
        generations = [fusion_steps(self.members, to_messages(p), opts) for p in prompts]
        outcomes = run_all(generations, min(max_concurrent or self.slots, self.slots))
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes  # type: ignore[return-value]

    def generate(self, prompt: Conversation, **options: Any) -> Result:
        """Run to completion and return the result with its provenance."""
        for event in self.stream(prompt, **options):
            if isinstance(event, DoneEvent):
                return event.result
        raise RuntimeError("the engine ended without a result")

    def close(self) -> None:
        for member in self.members:
            member.close()
        self.members = []

    def __enter__(self) -> "Ensemble":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_names_unique(members: Sequence[Member]) -> None:
    """Two copies of a model must not share a name (results are keyed by it)."""
    seen: dict[str, int] = {}
    for member in members:
        count = seen.get(member.name, 0) + 1
        seen[member.name] = count
        if count > 1:
            member.name = f"{member.name}#{count}"
