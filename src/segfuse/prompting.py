"""Turning messages into a member's prompt text.

Chat templates come from the model's own metadata (GGUF ``tokenizer.chat_template``)
and are rendered the way Hugging Face and llama.cpp do: a sandboxed Jinja
environment with ``trim_blocks``/``lstrip_blocks``. Base models without a
template use the plain ``Question: ... Answer:`` format.

A conversation that ends with an assistant message (a *prefill*) is continued: the members read it left
open, with no end of turn after it and no new generation prompt, and the answer is the continuation.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING

from jinja2 import BaseLoader, Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidRequestError, MemberLoadError
from .types import Message

if TYPE_CHECKING:
    from .models import PromptFormat


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=16)
def _compile(template: str) -> Template:
    env = ImmutableSandboxedEnvironment(loader=BaseLoader(), trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str, messages: Sequence[Message], bos_token: str, eos_token: str, add_generation_prompt: bool = True
) -> str:
    """Render a chat template (by default with the generation prompt for the assistant turn)."""
    try:
        return _compile(template).render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError as exc:
        raise InvalidRequestError(
            f"the model's chat template rejected the messages: {exc}",
            "check the message roles and their order",
        ) from None
    except Exception as exc:  # a template that cannot even compile is the model's fault
        raise MemberLoadError(f"the model's chat template failed: {exc}", "use another model file") from None


# A chat template as a backend renders it: (messages, add_generation_prompt) -> text.
TemplateRender = Callable[[Sequence[Message], bool], str]


def prefill_of(messages: Sequence[Message]) -> str:
    """The final assistant message the answer continues ("" when the conversation ends otherwise)."""
    return messages[-1].content if messages and messages[-1].role == "assistant" else ""


def chat_prompt(render: TemplateRender, messages: Sequence[Message], member: str) -> str:
    """`messages` through a chat template, ready for the answer: with the template's generation prompt,
    or, after a prefill, up to the end of its content (every backend's members read it so)."""
    if not prefill_of(messages):
        return render(messages, True)
    return _left_open(render, messages, member)


def _left_open(render: TemplateRender, messages: Sequence[Message], member: str) -> str:
    """The conversation rendered without a generation prompt and cut right after the prefill's content.

    Where the content lies comes from rendering once more with a unique placeholder in its place: the
    placeholder must appear once, and the real rendering must be the text before it then the content
    (as it is, or trimmed: templates often ``| trim``). A template that drops, repeats or rewrites the
    content, or whose markup before it depends on it, cannot leave the message open: refused.
    """
    content = messages[-1].content
    mark = f"\ue000{secrets.randbelow(10**12):012d}\ue001"
    skeleton = render([*messages[:-1], Message("assistant", mark)], False)
    text = render(messages, False)
    if skeleton.count(mark) == 1:
        head = skeleton.split(mark)[0]
        for filled in (content, content.strip()):
            if filled and text.startswith(head + filled):
                return head + filled
    raise InvalidRequestError(
        f"the chat template of {member} cannot leave an assistant message open for the answer to continue: "
        "it drops, repeats or rewrites the message's content",
        "end the conversation with a user message, or leave this member out",
    )


def content_spans(
    render: Callable[[Sequence[Message]], str], messages: Sequence[Message], text: str
) -> list[tuple[int, int]] | None:
    """Where the messages' contents lie in `text` = ``render(messages)`` (a chat template): character ranges.

    The template is rendered once more with a unique placeholder in place of each content; the
    contents then fill the placeholders, as they are or trimmed (templates often ``| trim`` them),
    and must give `text` back. None when they do not (the template rewrites contents).
    """
    nonce = f"{secrets.randbelow(10**12):012d}"  # digits: no template filter changes them
    marks = {f"\ue000{nonce}{i:04d}\ue001": m.content for i, m in enumerate(messages)}
    skeleton = render([Message(m.role, mark) for m, mark in zip(messages, marks)])
    parts = re.split("(" + "|".join(map(re.escape, marks)) + ")", skeleton)  # markup, mark, markup, ...
    spans, at = [], 0
    for i, part in enumerate(parts):
        if i % 2 == 0:  # template markup: must be there as rendered
            if not text.startswith(part, at):
                return None
            at += len(part)
            continue
        after = parts[i + 1]
        content = marks[part]
        for filled in (content, content.strip()):
            if text.startswith(filled, at) and text.startswith(after, at + len(filled)):
                spans.append((at, at + len(filled)))
                at += len(filled)
                break
        else:
            return None
    return spans if at == len(text) else None


def render_plain(messages: Sequence[Message]) -> str:
    """Question/Answer format for base models; system text goes first. A prefill is left open (no blank
    line after it)."""
    parts: list[str] = []
    for message in messages:
        if message.role == "system":
            parts.append(message.content.strip() + "\n\n")
        elif message.role == "user":
            parts.append(f"Question: {message.content.strip()}\nAnswer:")
        else:
            parts.append(f" {message.content.strip()}\n\n")
    if prefill_of(messages):
        parts[-1] = parts[-1].removesuffix("\n\n")
    return "".join(parts)


def raw_prompt(messages: Sequence[Message]) -> str | None:
    """The text of a text completion's prompt (one "raw" message), else None: a conversation."""
    return messages[0].content if len(messages) == 1 and messages[0].role == "raw" else None


def validate_messages(messages: Sequence[Message]) -> None:
    """The conversation must end with a non-empty user turn, or one and a prefill to continue (or be one
    non-empty raw prompt)."""
    if not messages:
        raise InvalidRequestError("no messages given", "pass a prompt or at least one user message")
    if any(m.role == "raw" for m in messages):
        if len(messages) != 1:
            raise InvalidRequestError("a raw prompt cannot be part of a conversation", "send it alone")
        if not messages[0].content:
            raise InvalidRequestError("the prompt is empty", "write the text to continue")
        return
    last = messages[-1]
    if last.role == "assistant":
        _check_prefill(last.content)
        if len(messages) < 2 or messages[-2].role != "user":
            raise InvalidRequestError(
                "an assistant message to continue (a prefill) must follow a user message", "put the question before it"
            )
        last = messages[-2]
    if last.role != "user":
        raise InvalidRequestError(
            "the last message must be from the user, or from the assistant (a prefill to continue) after the user's",
            "end the conversation with a question",
        )
    if not last.content.strip():
        raise InvalidRequestError("the prompt is empty", "write a question")


def _check_prefill(content: str) -> None:
    """A prefill ending in whitespace is refused, as Anthropic refuses it: templates that trim contents
    would drop it for some members and not others, and a word's token carries its leading space."""
    if content[-1:].isspace():
        raise InvalidRequestError(
            "the final assistant message (a prefill to continue) ends with whitespace",
            "remove the trailing whitespace: the answer may begin with it",
        )


def without_empty_prefill(messages: Sequence[Message]) -> list[Message]:
    """`messages` less a final empty assistant message: nothing to continue, the answer starts afresh
    (Anthropic accepts an empty final assistant message)."""
    if len(messages) > 1 and messages[-1] == Message("assistant", ""):
        return list(messages[:-1])
    return list(messages)


def choose_format(declared: PromptFormat | None, chat_template: str | None, name: str) -> PromptFormat:
    """The member's prompt format: the declared one, else its chat template, else plain Question/Answer."""
    from .models import CHAT, QUESTION_ANSWER

    chosen = declared or (CHAT if chat_template else QUESTION_ANSWER)
    if chosen.style == "chat" and not chat_template:
        raise MemberLoadError(
            f"{name} has no chat template in its metadata", "use the plain Question/Answer format for base models"
        )
    return chosen
