"""Chat requests -> what the worker takes: tools, constraints, messages and fusion options (``ChatPlan``).

Chat completions plan their body here (``plan_chat``); Messages and Responses translate theirs to the chat
request it means and plan that (``plan_of``), so the three cannot drift apart. Everything here raises
``serving.APIError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import LimitsSection
from ...constraints import Constraint
from ...errors import InvalidRequestError
from ...options import FusionOptions
from ...request import FusionRequest, check_prefill, to_messages
from ...tools import (
    Tool,
    call_text,
    chosen_tools,
    parse_tools,
    render,
    result_text,
    tool_constraint,
)
from ...types import Message
from .. import limits as checks
from ..parsing import DEFAULT_LIMITS, Defaults, Endpoint, fusion_options, parse_request
from ..serving import APIError
from .protocol import NEUTRAL_PARAMETERS, SUPPORTED_PARAMETERS, ChatCompletionRequest

CHAT = Endpoint(ChatCompletionRequest, SUPPORTED_PARAMETERS, NEUTRAL_PARAMETERS, checks.check_chat)


def top_logprobs(request: ChatCompletionRequest) -> int | None:
    """How many alternatives per answer token the chat request asks for (None: no logprobs)."""
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def offered_tools(request: ChatCompletionRequest) -> tuple[list[Tool], str]:
    """``tools`` and ``tool_choice`` -> (the tools offered, "none" | "auto" | "required"); 400 naming the field."""
    try:
        tools = parse_tools(request.tools or [])
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_value", param="tools") from None
    try:
        return chosen_tools(tools, request.tool_choice)
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_value", param="tool_choice") from None


def constraint_of(
    request: ChatCompletionRequest, tools: list[Tool] | None = None, mode: str = "none"
) -> Constraint | None:
    """``response_format`` (or the tools offered) -> what the answer must be (None: free text); 400 naming
    the field when it is wrong."""
    spec = request.response_format
    if tools and mode != "none":
        if spec is not None and spec.get("type") != "text":
            raise APIError(
                400,
                "response_format and tools together: the answer is either a tool call or the format",
                code="invalid_value",
                param="response_format",
            )
        return tool_constraint(tools, mode)
    if spec is None:
        return None
    kind = spec.get("type")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return Constraint.json_object()
        if kind == "json_schema":
            inner = spec.get("json_schema")
            if not isinstance(inner, dict) or "schema" not in inner:
                raise InvalidRequestError(
                    "response_format.json_schema must be an object with a 'schema'",
                    '{"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}',
                )
            return Constraint.json_schema(
                inner["schema"], inner.get("name"), where="response_format.json_schema.schema"
            )
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_value", param="response_format") from None
    raise APIError(
        400,
        f"response_format.type {kind!r} is not supported: use text, json_object or json_schema",
        code="invalid_value",
        param="response_format",
    )


def check_continuation(request: ChatCompletionRequest) -> None:
    """vLLM's ``continue_final_message`` and ``add_generation_prompt``, where given, must say what segfuse
    does anyway: continue a final assistant message, and answer any other last message with a new turn."""
    last = request.messages[-1]
    if last.role == "assistant" and last.tool_calls:
        raise APIError(
            400,
            "the conversation ends with the assistant's tool call: send its result (a tool "
            "message) or a user message after it",
            code="invalid_messages",
            param="messages",
        )
    ends_open = last.role == "assistant"
    wrong = {
        "continue_final_message": request.continue_final_message not in (None, ends_open),
        "add_generation_prompt": request.add_generation_prompt not in (None, not ends_open),
    }
    for field, contradicts in wrong.items():
        said = f"{field} {str(getattr(request, field)).lower()}"
        if contradicts and ends_open:
            raise APIError(
                400,
                f"{said} asks for a new assistant turn after the final assistant message, which "
                "segfuse continues (a prefill): drop the field, or end with a user message",
                code="invalid_value",
                param=field,
            )
        if contradicts:
            raise APIError(
                400,
                f"{said} asks to continue the final message, which is from the {last.role}; "
                "segfuse continues only an assistant's: drop the field, or end with the start of "
                "the assistant's answer",
                code="invalid_value",
                param=field,
            )


def to_engine_messages(
    request: ChatCompletionRequest, tools: list[Tool] | None = None, mode: str = "none"
) -> list[Message]:
    """The conversation as the members read it: earlier tool calls and results in plain text, the tools
    offered noted in the system message (tools.py); a final assistant message is continued."""
    check_continuation(request)
    messages: list[Message] = []
    names: dict[str, str] = {}  # call id -> function name, to say whose result a tool turn is
    results: list[str] = []  # consecutive tool turns: the results of one turn's calls, sent as one user turn

    def flush() -> None:
        if results:
            messages.append(Message("user", "\n\n".join(results)))  # joined once: linear in the results
            results.clear()

    for m in request.messages:
        if m.role == "tool":
            results.append(result_text(names.get(m.tool_call_id or "") or m.name, m.tool_call_id, m.text()))
            continue
        flush()
        if m.role == "assistant" and m.tool_calls:
            names.update({c.id or "": c.function.name for c in m.tool_calls})
            text = "\n".join(call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            messages.append(Message("assistant", (m.text() + "\n" + text).strip()))
        else:
            messages.append(Message("system" if m.role == "developer" else m.role, m.text()))
    flush()
    messages = render(messages, tools or [], mode)
    try:
        return to_messages(messages)
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_messages", param="messages") from None


@dataclass(frozen=True)
class ChatPlan:
    """A chat request made ready for the worker (``plan_chat``): the generation it asks for (its members
    and deadline come with its job), and what the server answers with."""

    request: ChatCompletionRequest
    fusion: FusionRequest  # the messages, options, constraint, top log-probabilities and cache salt
    tools: list[Tool]  # offered to the answer ([] with tool_choice "none")
    logprobs: bool  # the answer's log-probabilities are reported


def plan_chat(body: bytes, defaults: FusionOptions | Defaults, limits: LimitsSection = DEFAULT_LIMITS) -> ChatPlan:
    """Body bytes -> everything the worker needs: parsing, limits, tools, messages, options, the compiled
    constraint. CPU work on client input, bounded by ``limits``: the app runs it off the event loop."""
    return plan_of(parse_request(body, CHAT, limits), defaults, limits)


def plan_of(
    request: ChatCompletionRequest, defaults: FusionOptions | Defaults, limits: LimitsSection = DEFAULT_LIMITS
) -> ChatPlan:
    """A validated chat request (of any API: Messages and Responses translate theirs) -> its plan."""
    try:
        tools, mode = offered_tools(request)
    except RecursionError:  # the schema checker recurses: limits raised too far for it
        raise checks.exceeded(
            "tools", "a schema nests too deeply to check", limits.max_schema_depth, "max_schema_depth"
        ) from None
    top = top_logprobs(request)
    messages = to_engine_messages(request, tools, mode)
    options = fusion_options(request, defaults)
    try:
        constraint = constraint_of(request, tools, mode)
    except RecursionError:
        raise checks.exceeded(
            "response_format", "the schema nests too deeply to check", limits.max_schema_depth, "max_schema_depth"
        ) from None
    try:
        check_prefill(constraint, messages)
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_messages", param="messages") from None
    # Built from what was checked above, naming the field at fault: the request is not checked again.
    fusion = FusionRequest(
        messages, options, constraint=constraint, top_logprobs=top or 0, cache_salt=request.cache_salt
    )
    return ChatPlan(request, fusion, tools if mode != "none" else [], top is not None)


__all__ = [
    "CHAT",
    "ChatPlan",
    "check_continuation",
    "constraint_of",
    "offered_tools",
    "plan_chat",
    "plan_of",
    "to_engine_messages",
    "top_logprobs",
]
