"""One fused generation asked for: made once at the edge, whatever the interface, and carried whole.

The Python API (``Ensemble.generate``, ``stream``, ``steps``), the CLI, the server's four APIs, eval,
bench and the llm plugin each make one :class:`FusionRequest` and hand it to ``Ensemble.steps``; the
engine reads it there and nowhere else. :meth:`FusionRequest.of` validates the conversation
(:func:`to_messages`) and that the constraint admits its prefill (:func:`check_prefill`); the
constructor takes both as checked already: the server's parsing checks them itself, to name the
request field at fault, and then builds the request. Nothing checks a request's messages again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .constraints import Constraint
from .errors import InvalidRequestError
from .options import FusionOptions
from .prompting import prefill_of, validate_messages, without_empty_prefill
from .types import Message, is_role

Conversation = str | Sequence[Message | Mapping[str, str]]


def to_messages(prompt: Conversation) -> list[Message]:
    """A prompt string or a list of messages (dicts or Message) -> validated messages. A final assistant
    message is a prefill: the answer continues it (an empty one is dropped)."""
    if isinstance(prompt, str):
        messages = [Message("user", prompt)]
    else:
        messages = []
        for item in prompt:
            if isinstance(item, Message):
                messages.append(item)
                continue
            role, content = item.get("role"), item.get("content")
            if not is_role(role) or not isinstance(content, str):
                raise InvalidRequestError(
                    f"bad message {dict(item)!r}",
                    "each message needs role system/user/assistant (or raw: a text to continue) and string content",
                )
            messages.append(Message(role, content))
    messages = without_empty_prefill(messages)
    validate_messages(messages)
    return messages


def check_prefill(constraint: Constraint | None, messages: Sequence[Message]) -> None:
    """Under a constraint, the prefill (a final assistant message) must begin an answer it allows."""
    if constraint is not None:
        constraint.check_prefill(prefill_of(messages))


@dataclass(frozen=True)
class FusionRequest:
    """What one fused generation is asked to do.

    `messages`: the conversation, validated (a final assistant message is a prefill to continue);
    `members`: the members that answer, by name (None: all); `weights`: starting voting weights by
    member name (Hedge carried across queries; None: uniform); `constraint`: what the answer must be
    (structured output); `top_logprobs`: how many likeliest tokens each drafter reports per position;
    `deadline`: a ``time.monotonic()`` time after which the answer so far ends (finish reason
    "deadline"); `cache_salt`: members reuse only prompt prefixes cached under the same salt.
    """

    messages: Sequence[Message]  # kept as a tuple, as members are
    options: FusionOptions
    members: Sequence[str] | None = None
    weights: Mapping[str, float] | None = None
    constraint: Constraint | None = None
    top_logprobs: int = 0
    deadline: float | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # Copies the caller cannot change afterwards: the request stays what it was when it was made.
        object.__setattr__(self, "messages", tuple(self.messages))
        if self.members is not None:
            object.__setattr__(self, "members", tuple(self.members))
        if self.weights is not None:
            object.__setattr__(self, "weights", dict(self.weights))

    @classmethod
    def of(
        cls,
        prompt: Conversation,
        options: FusionOptions,
        *,
        members: Sequence[str] | None = None,
        weights: Mapping[str, float] | None = None,
        constraint: Constraint | None = None,
        top_logprobs: int = 0,
        deadline: float | None = None,
        cache_salt: str | None = None,
    ) -> FusionRequest:
        """A request for `prompt` (a string, or messages as dicts or Message), checked: the conversation,
        and the prefill against the constraint."""
        messages = to_messages(prompt)
        check_prefill(constraint, messages)
        return cls(messages, options, members, weights, constraint, top_logprobs, deadline, cache_salt)


__all__ = ["Conversation", "FusionRequest", "check_prefill", "to_messages"]
