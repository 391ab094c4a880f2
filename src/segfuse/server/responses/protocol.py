"""OpenAI Responses wire types (``POST /v1/responses``) and their translation to a chat request.

``input`` (a string, or items: messages, ``function_call`` and ``function_call_output``), ``instructions``,
function ``tools``, ``tool_choice`` and ``text.format`` become the chat request they mean (``to_chat``),
after the conversation a ``previous_response_id`` continues; the chat planner does the rest.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..chat.protocol import ChatCompletionRequest, named_tool_choice
from ..serving import APIError
from ..wire import KEEP_ALIVE, MAX_CACHE_SALT_CHARS

PATH = "/v1/responses"


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # annotations, logprobs of an earlier output

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # an earlier output's id and status

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(description="a user message, or a list of input items")
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = Field(
        None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}'
    )
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    segfuse: dict[str, Any] | None = Field(None, description="segfuse options, as on chat completions")
    keep_alive: str | int | float | None = Field(None, description=KEEP_ALIVE)


RESPONSES_PARAMETERS: tuple[str, ...] = tuple(ResponsesRequest.model_fields)
# OpenAI parameters accepted only at a value that asks for nothing (null is neutral for each).
RESPONSES_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "truncation": ("disabled",),
    "include": ([],),
    "reasoning": (),
    "background": (False,),
    "top_logprobs": (0,),
    "max_tool_calls": (),
    "prompt": (),
    "conversation": (),
    "stream_options": (),
}


def _item(data: dict[str, Any], where: str) -> BaseModel:
    kind = data.get("type", "message") if isinstance(data, dict) else None
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise APIError(
            400,
            f"{where}: input item type {kind!r} is not supported: segfuse reads messages "
            "of text, function_call and function_call_output items",
            code="invalid_value",
            param=where,
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        inner = ".".join(str(p) for p in first["loc"])
        raise APIError(
            400, f"{where}.{inner}: {first['msg']}", code="invalid_value", param=f"{where}.{inner}"
        ) from None


def _calls(calls: list[FunctionCallItem]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ],
    }


def conversation(request: ResponsesRequest, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of `earlier` turns (a stored response's) and this request's input, without the
    instructions (they are not carried from one response to the next)."""
    messages = list(earlier)
    called = {c["id"] for m in earlier for c in m.get("tool_calls") or []}
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    pending: list[FunctionCallItem] = []  # consecutive calls: one assistant turn
    for i, data in enumerate(items):
        item = _item(data, f"input.{i}")
        if isinstance(item, FunctionCallItem):
            pending.append(item)
            called.add(item.call_id)
            continue
        if pending:
            messages.append(_calls(pending))
            pending = []
        if isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise APIError.invalid(
                    f"input.{i}.call_id", f"no earlier function_call has the call_id {item.call_id!r}"
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
    if pending:
        messages.append(_calls(pending))
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    chat = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(
                400,
                f"tools.{i}: tool type {kind!r} is not supported: segfuse serves function tools",
                code="invalid_value",
                param=f"tools.{i}.type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        chat.append({"type": "function", "function": function})
    return chat or None


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    return named_tool_choice(choice, "function", '"none", "auto", "required" or {"type": "function", "name": ...}')


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    text = text or {}
    if set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None, "medium"):
        raise APIError(
            400,
            "text: segfuse reads text.format only (verbosity: medium or null)",
            code="unsupported_parameter",
            param="text",
        )
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(
            400,
            'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": '
            '"json_schema", "name": ..., "schema": {...}}',
            code="invalid_value",
            param="text.format",
        )
    if spec["type"] != "json_schema":
        return {"type": spec["type"]}
    inner = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
    return {"type": "json_schema", "json_schema": inner}


def to_chat(request: ResponsesRequest, earlier: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request means, after the `earlier` conversation it continues."""
    messages = conversation(request, earlier)
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    if not messages:
        raise APIError(400, "input: give at least one item", code="invalid_value", param="input")
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": _tools(request.tools),
        "tool_choice": _tool_choice(request.tool_choice),
        "response_format": _format(request.text),
        "user": request.user,
        "cache_salt": request.cache_salt,
        "segfuse": request.segfuse,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise APIError(
            400, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}", code="invalid_value", param="input"
        ) from None


__all__ = ["PATH", "RESPONSES_NEUTRAL", "RESPONSES_PARAMETERS", "ResponsesRequest", "conversation", "to_chat"]
