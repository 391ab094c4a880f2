"""OpenAI chat-completions wire types (pydantic only, no behaviour; what every API shares: ``wire``).

Parsed strictly, as ``wire`` says; a request field segfuse does not implement is refused unless
it is tolerated (``wire.TOLERATED_PARAMETERS``) or neutral (``NEUTRAL_PARAMETERS`` below).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ..serving import APIError
from ..wire import FusionInfo, GenerationRequest, Usage

PATH = "/v1/chat/completions"

# --------------------------------------------------------------------------- requests


class TextPart(BaseModel):
    """One part of an array-valued message content; only text is supported."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """The function an earlier tool call named, and its arguments as JSON text (as OpenAI sends them)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    """One call of an earlier assistant turn (``messages[i].tool_calls[j]``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null only for an assistant turn that called tools
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """The body of ``POST /v1/chat/completions``.

    Other fields are kept in ``model_extra``; ``parsing.parse_request`` refuses
    them unless they are tolerated or neutral (the tables below).
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = Field(None, description="function tools the answer may call")
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description='"none", "auto" (default with tools), "required", or {"type": "function", "function": '
        '{"name": ...}}',
    )
    response_format: dict[str, Any] | None = Field(
        None,
        description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
        '{"name": ..., "schema": {...}, "strict": true}}',
    )
    logprobs: bool | None = Field(None, description="each answer token's log-probability under its author")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="with logprobs: the author's most likely tokens at each position (up to 20)"
    )
    # vLLM's names for continuing a final assistant message, which segfuse does whenever there is one:
    # accepted where they say the same (planning.check_continuation).
    continue_final_message: bool | None = Field(
        None, description="true: the final message is the assistant's, continued (segfuse continues one anyway)"
    )
    add_generation_prompt: bool | None = Field(
        None, description="false: the final message is the assistant's, continued (segfuse continues one anyway)"
    )

    @property
    def answer_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# Which request fields mean what. Everything else, but the tolerated ones (wire.TOLERATED_PARAMETERS), gets
# 400 unsupported_parameter (parsing.unsupported).
# Implemented: the fields of ChatCompletionRequest above.
SUPPORTED_PARAMETERS: tuple[str, ...] = tuple(ChatCompletionRequest.model_fields)
# OpenAI parameters segfuse does not implement, accepted only at a value that asks for nothing
# (their default); null is neutral for every one of them. Compared strictly: `false` is not `0`.
NEUTRAL_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
}


# --------------------------------------------------------------------------- responses


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _no_empty_calls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k != "tool_calls" or v is not None}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobInfo(TopLogprob):
    """One answer token, as its author (``model``, our extension) drafted it."""

    top_logprobs: list[TopLogprob]
    model: str | None = None


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobInfo] | None
    refusal: None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    segfuse: FusionInfo


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    segfuse: FusionInfo | None = None


def named_tool_choice(choice: dict[str, Any], kind: str, allowed: str) -> dict[str, Any]:
    """Chat's ``tool_choice`` for another API's choice of one named tool, ``{"type": kind, "name": ...}``;
    400 saying what `allowed` choices there are for anything else."""
    if choice.get("type") == kind and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice must be {allowed}", code="invalid_value", param="tool_choice")
