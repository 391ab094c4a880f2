"""Request bodies -> what the engine takes: strict parsing, fusion options, tools, constraints, messages.

A request field segfuse does not implement is refused (400 ``unsupported_parameter``) unless it is
tolerated or neutral (``protocol``'s tables); everything here raises ``serving.APIError``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ..config import LimitsSection
from ..constraints import Constraint
from ..ensemble import to_messages
from ..errors import InvalidRequestError
from ..options import FusionOptions
from ..prompting import prefill_of
from ..tools import (
    Tool,
    call_text,
    chosen_tools,
    parse_tools,
    render,
    result_text,
    tool_constraint,
)
from ..types import Message
from . import limits as checks
from .chat.protocol import (
    NEUTRAL_PARAMETERS,
    SUPPORTED_PARAMETERS,
    ChatCompletionRequest,
)
from .serving import APIError
from .wire import TOLERATED_PARAMETERS

log = logging.getLogger("segfuse.server")


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (``false`` is not ``0``)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    if isinstance(neutral, int | float):
        return isinstance(value, int | float) and value == neutral
    if isinstance(neutral, dict):
        return (isinstance(value, dict) and value.keys() == neutral.keys()
                and all(_same(value[k], neutral[k]) for k in neutral))
    if isinstance(neutral, list):
        return isinstance(value, list) and len(value) == len(neutral) and all(map(_same, value, neutral))
    return type(value) is type(neutral) and value == neutral


@dataclass(frozen=True)
class Endpoint:
    """What one endpoint's body may hold: its request type, which other OpenAI fields pass, and the
    ``[limits]`` check of a validated request."""

    request: type[BaseModel]
    supported: tuple[str, ...]
    neutral: dict[str, tuple[Any, ...]]
    check: Callable[[Any, LimitsSection], None] | None = None


CHAT = Endpoint(ChatCompletionRequest, SUPPORTED_PARAMETERS, NEUTRAL_PARAMETERS, checks.check_chat)
DEFAULT_LIMITS = LimitsSection()


def unsupported(data: dict[str, Any], endpoint: Endpoint = CHAT) -> list[str]:
    """The request fields segfuse would have to ignore to answer, in body order.

    Supported fields, tolerated ones and OpenAI parameters at a neutral value
    (null included) pass; anything else would change what the client asked for.
    """
    refused = []
    for name, value in data.items():
        if name in endpoint.supported or name in TOLERATED_PARAMETERS:
            continue
        neutral = endpoint.neutral.get(name)
        if neutral is not None and (value is None or any(_same(value, n) for n in neutral)):
            continue
        refused.append(name)
    return refused


def unsupported_error(names: list[str], endpoint: Endpoint = CHAT) -> APIError:
    """400 unsupported_parameter naming the first refused field (and the others in the message)."""
    first = names[0]
    if first in endpoint.neutral:
        neutral = " or ".join([json.dumps(v) for v in endpoint.neutral[first]] + ["null"])
        why = f"unsupported parameter {first!r}: segfuse does not implement it (accepted only as {neutral})"
    elif first in FusionOptions.model_fields:
        why = (f"unsupported parameter {first!r}: fusion options go in the 'segfuse' object, "
               f'as {{"segfuse": {{"{first}": ...}}}}')
    else:
        why = f"unsupported parameter {first!r}: segfuse does not know it"
    also = f" (also unsupported: {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    supported = ", ".join(endpoint.supported)
    return APIError(400, f"{why}{also}. Supported parameters: {supported} (see docs/server.md)",
                    code="unsupported_parameter", param=first)


def parse_request(body: bytes, endpoint: Endpoint = CHAT, limits: LimitsSection = DEFAULT_LIMITS) -> Any:
    """JSON bytes -> a validated request (a ChatCompletionRequest by default) within ``limits``.

    400 for bad JSON, a parameter segfuse does not implement (``unsupported``) or a limit passed
    (``limit_exceeded``), 422 for a bad shape.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # thousands of nested brackets: refused like any body nested too deeply
        raise checks.exceeded("body", "objects and arrays nest too deeply", limits.max_json_depth,
                              "max_json_depth") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    checks.check_body_depth(data, limits)
    _refuse_lone_surrogates(data)
    refused = unsupported(data, endpoint)
    if refused:
        raise unsupported_error(refused, endpoint)
    try:
        request = endpoint.request.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise APIError(422, f"{where}: {first['msg']}{more}", code="invalid_value", param=where or None) from None
    if endpoint.check is not None:
        endpoint.check(request, limits)
    if request.model_extra:
        log.debug("ignoring fields that do not change the answer: %s", ", ".join(sorted(request.model_extra)))
    return request


def _refuse_lone_surrogates(data: Any, where: str = "") -> None:
    """400 naming the field of a string that holds half of a UTF-16 pair (JSON's "\\ud800"): no
    tokenizer can encode it. The body's depth is bounded before this walk."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{where or 'body'}: the text holds a lone UTF-16 surrogate, which is not a "
                           "character; send valid Unicode", code="invalid_value", param=where or None) from None
    elif isinstance(data, dict):
        for key, value in data.items():
            _refuse_lone_surrogates(key, where)
            _refuse_lone_surrogates(value, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _refuse_lone_surrogates(value, f"{where}.{i}" if where else str(i))


def fusion_options(request: Any, defaults: FusionOptions) -> FusionOptions:
    """The server's defaults with whatever the request sets on top."""
    values: dict[str, Any] = defaults.model_dump()
    asked = {
        "max_tokens": request.answer_budget,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "stop": request.stop,
    }
    values.update({k: v for k, v in asked.items() if v is not None})
    if "hedge_persist" in (request.segfuse or {}):  # it would change every later request, not this one
        raise APIError(400, "hedge_persist is the server's setting ([server] hedge_persist), not a request's",
                       code="unsupported_parameter", param="segfuse.hedge_persist")
    values.update(request.segfuse or {})  # an explicit null is a value here (gate or accept_margin: none)
    try:
        return FusionOptions.build(**values)
    except InvalidRequestError as exc:
        raise APIError(400, exc.message, code="invalid_value", param=_option_param(request, exc.field)) from None


def _option_param(request: Any, field: str | None) -> str | None:
    """Where the client wrote a refused fusion option: top level (seed, stop, ...) or in ``segfuse``."""
    if field is None:
        return None
    name = field.split(".")[0]
    if name in (request.segfuse or {}):
        return f"segfuse.{field}"
    return name


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


def constraint_of(request: ChatCompletionRequest, tools: list[Tool] | None = None,
                  mode: str = "none") -> Constraint | None:
    """``response_format`` (or the tools offered) -> what the answer must be (None: free text); 400 naming
    the field when it is wrong."""
    spec = request.response_format
    if tools and mode != "none":
        if spec is not None and spec.get("type") != "text":
            raise APIError(400, "response_format and tools together: the answer is either a tool call or the "
                                "format", code="invalid_value", param="response_format")
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
                raise InvalidRequestError("response_format.json_schema must be an object with a 'schema'",
                                          '{"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}')
            return Constraint.json_schema(inner["schema"], inner.get("name"),
                                          where="response_format.json_schema.schema")
    except InvalidRequestError as exc:
        raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_value", param="response_format") from None
    raise APIError(400, f"response_format.type {kind!r} is not supported: use text, json_object or json_schema",
                   code="invalid_value", param="response_format")


def check_continuation(request: ChatCompletionRequest) -> None:
    """vLLM's ``continue_final_message`` and ``add_generation_prompt``, where given, must say what segfuse
    does anyway: continue a final assistant message, and answer any other last message with a new turn."""
    last = request.messages[-1]
    if last.role == "assistant" and last.tool_calls:
        raise APIError(400, "the conversation ends with the assistant's tool call: send its result (a tool "
                       "message) or a user message after it", code="invalid_messages", param="messages")
    ends_open = last.role == "assistant"
    wrong = {"continue_final_message": request.continue_final_message not in (None, ends_open),
             "add_generation_prompt": request.add_generation_prompt not in (None, not ends_open)}
    for field, contradicts in wrong.items():
        said = f"{field} {str(getattr(request, field)).lower()}"
        if contradicts and ends_open:
            raise APIError(400, f"{said} asks for a new assistant turn after the final assistant message, which "
                           "segfuse continues (a prefill): drop the field, or end with a user message",
                           code="invalid_value", param=field)
        if contradicts:
            raise APIError(400, f"{said} asks to continue the final message, which is from the {last.role}; "
                           "segfuse continues only an assistant's: drop the field, or end with the start of "
                           "the assistant's answer", code="invalid_value", param=field)


def to_engine_messages(request: ChatCompletionRequest, tools: list[Tool] | None = None,
                       mode: str = "none") -> list[Message]:
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
    """A chat request made ready for the worker (``plan_chat``)."""

    request: ChatCompletionRequest
    messages: list[Message]
    options: FusionOptions
    constraint: Constraint | None
    tools: list[Tool]  # offered to the answer ([] with tool_choice "none")
    top_logprobs: int | None  # None: no logprobs


def plan_chat(body: bytes, defaults: FusionOptions, limits: LimitsSection = DEFAULT_LIMITS) -> ChatPlan:
    """Body bytes -> everything the worker needs: parsing, limits, tools, messages, options, the compiled
    constraint. CPU work on client input, bounded by ``limits``: the app runs it off the event loop."""
    return plan_of(parse_request(body, CHAT, limits), defaults, limits)


def plan_of(request: ChatCompletionRequest, defaults: FusionOptions,
            limits: LimitsSection = DEFAULT_LIMITS) -> ChatPlan:
    """A validated chat request (of any API: Messages and Responses translate theirs) -> its plan."""
    try:
        tools, mode = offered_tools(request)
    except RecursionError:  # the schema checker recurses: limits raised too far for it
        raise checks.exceeded("tools", "a schema nests too deeply to check", limits.max_schema_depth,
                              "max_schema_depth") from None
    top = top_logprobs(request)
    messages = to_engine_messages(request, tools, mode)
    options = fusion_options(request, defaults)
    try:
        constraint = constraint_of(request, tools, mode)
    except RecursionError:
        raise checks.exceeded("response_format", "the schema nests too deeply to check", limits.max_schema_depth,
                              "max_schema_depth") from None
    if constraint is not None:
        try:
            constraint.check_prefill(prefill_of(messages))
        except InvalidRequestError as exc:
            raise APIError(400, f"{exc.message} ({exc.hint})", code="invalid_messages", param="messages") from None
    return ChatPlan(request, messages, options, constraint, tools if mode != "none" else [], top)


__all__ = [
    "CHAT",
    "ChatPlan",
    "Endpoint",
    "check_continuation",
    "constraint_of",
    "fusion_options",
    "offered_tools",
    "parse_request",
    "plan_chat",
    "plan_of",
    "to_engine_messages",
    "top_logprobs",
    "unsupported",
    "unsupported_error",
]
