"""Anthropic Messages wire types (``POST /v1/messages``) and their translation to a chat request.

A Messages request becomes the chat request it means (``to_chat``): the system
text, text turns, ``tool_use`` blocks as an assistant's tool calls and
``tool_result`` blocks as tool turns, ``tools`` with their ``input_schema``,
``tool_choice`` (auto, any, tool, none), ``stop_sequences``. The chat planner
then does the rest, so the two APIs cannot drift apart. Parsed strictly, as chat.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from ..chat.protocol import ChatCompletionRequest, named_tool_choice
from ..serving import APIError
from ..wire import KEEP_ALIVE, MAX_CACHE_SALT_CHARS, FusionInfo

PATH = "/v1/messages"  # its errors, and those of the paths under it, are in Anthropic's shape
BLOCK_TYPES = ("text", "tool_use", "tool_result")


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # cache_control, citations: no effect here

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


Block = TextBlock | ToolUseBlock | ToolResultBlock


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: object) -> object:
        for block in value if isinstance(value, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise PydanticCustomError(
                    "block_type",
                    "content block type {kind} is not supported: segfuse reads text, tool_use and tool_result blocks",
                    {"kind": repr(kind)},
                )
        return value


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) are not served
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/messages`` (``max_tokens`` required, as Anthropic's)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = Field(
        None, description='{"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}'
    )
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    segfuse: dict[str, Any] | None = Field(None, description="segfuse options, as on chat completions")
    keep_alive: str | int | float | None = Field(None, description=KEEP_ALIVE)


class CountTokensRequest(MessagesRequest):
    """The body of ``POST /v1/messages/count_tokens``: a Messages request without the answer's budget."""

    max_tokens: int = Field(1, ge=1)


MESSAGES_PARAMETERS: tuple[str, ...] = tuple(MessagesRequest.model_fields)
# Anthropic parameters accepted only at a value that asks for nothing (null is neutral for each).
MESSAGES_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_k": (),
    "thinking": ({"type": "disabled"},),
    "mcp_servers": ([],),
    "container": (),
}


def _system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n\n".join(b.text for b in system) or None


def _assistant_turn(content: list[Any], where: str, called: set[str]) -> dict[str, Any]:
    text = "".join(b.text for b in content if isinstance(b, TextBlock))
    calls = []
    for j, block in enumerate(content):
        if isinstance(block, ToolResultBlock):
            raise APIError.invalid(f"{where}.content.{j}", "a tool_result belongs in a user turn")
        if isinstance(block, ToolUseBlock):
            called.add(block.id)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)},
                }
            )
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    return {**turn, "tool_calls": calls} if calls else turn


def _user_turns(content: list[Any], where: str, called: set[str]) -> list[dict[str, Any]]:
    turns, text = [], []
    for j, block in enumerate(content):
        if isinstance(block, ToolUseBlock):
            raise APIError.invalid(f"{where}.content.{j}", "a tool_use belongs in an assistant turn")
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in called:
                raise APIError.invalid(
                    f"{where}.content.{j}.tool_use_id", f"no earlier tool_use has the id {block.tool_use_id!r}"
                )
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        else:
            text.append(block.text)
    return turns + ([{"role": "user", "content": "".join(text)}] if text else [])


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    return named_tool_choice(
        choice, "tool", '{"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...}'
    )


def to_chat(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request means (400 naming the field for what cannot be one)."""
    messages: list[dict[str, Any]] = []
    if (system := _system_text(request.system)) is not None:
        messages.append({"role": "system", "content": system})
    called: set[str] = set()
    for i, m in enumerate(request.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            messages.append(_assistant_turn(m.content, f"messages.{i}", called))
        else:
            messages.extend(_user_turns(m.content, f"messages.{i}", called))
    tools = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in request.tools or []
    ]
    user = (request.metadata or {}).get("user_id")
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stop": request.stop_sequences,
        "tools": tools or None,
        "tool_choice": _tool_choice(request.tool_choice),
        "user": user if isinstance(user, str) else None,
        "cache_salt": request.cache_salt,
        "segfuse": request.segfuse,
    }
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


# --------------------------------------------------------------------------- responses


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None = None
    usage: MessagesUsage
    segfuse: FusionInfo | None = None


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape; our ``code`` and ``param`` ride along for clients that read them."""
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    detail = {"type": kind, "message": error.detail.message, "code": error.detail.code, "param": error.detail.param}
    return {"type": "error", "error": {k: v for k, v in detail.items() if v is not None}}


__all__ = [
    "MESSAGES_NEUTRAL",
    "MESSAGES_PARAMETERS",
    "PATH",
    "AnthropicResponse",
    "CountTokensRequest",
    "MessagesRequest",
    "MessagesUsage",
    "error_body",
    "to_chat",
]
