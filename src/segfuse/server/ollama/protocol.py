"""Ollama's wire types (``/api/chat``, ``/api/generate``, ``/api/show``) and its error shape.

Ollama's own API, beside the OpenAI and Anthropic ones: requests stream by default, as NDJSON (one JSON
object a line); ``options`` carries the sampling settings; ``format`` asks for JSON. What a request means
for the worker is planned in ``planning``. Parsed strictly as the other APIs are: a top-level field
Ollama has but segfuse does not implement is refused unless it is at a value that asks for nothing
(``NEUTRAL``). Inside ``options``, Ollama's server skips what it does not know, and so does this one
(``IGNORED_OPTIONS`` says which, docs/server.md says why).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..serving import APIError
from ..wire import KEEP_ALIVE, MAX_CACHE_SALT_CHARS

PREFIX = "/api/"  # every path of Ollama's API: its errors are in Ollama's shape
CHAT_PATH = "/api/chat"
GENERATE_PATH = "/api/generate"
# The Ollama release whose API these shapes follow: clients read it to know which features they may use.
OLLAMA_VERSION = "0.12.0"
LATEST = ":latest"  # the tag Ollama's clients add to a bare name


class Options(BaseModel):
    """``options``: the settings that change the answer, checked; Ollama's others are read and skipped."""

    model_config = ConfigDict(extra="allow", strict=True)

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    num_predict: int | None = Field(None, description="the answer's tokens; -1, -2 (no bound): the server's budget")
    stop: str | list[str] | None = None
    num_ctx: int | None = Field(None, ge=1, description="read, not applied: each member's window is set at load")


# Options Ollama knows that do not apply here: load-time settings (the server loads its members once, for
# every client), and samplers the engine does not have. Skipped rather than refused: clients send Ollama's
# defaults of them (docs/server.md says so).
IGNORED_OPTIONS = frozenset(
    {
        "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
        "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "top_k", "min_p", "tfs_z",
        "typical_p", "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty", "mirostat",
        "mirostat_tau", "mirostat_eta", "penalize_newline",
    }
)  # fmt: skip


class OllamaFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, not JSON text as OpenAI's


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | None = None
    function: OllamaFunction


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # thinking: an earlier answer's, not read

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None  # refused unless empty: no member reads images
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool turn: the tool whose result it is
    tool_call_id: str | None = None


class OllamaRequest(BaseModel):
    """What ``/api/chat`` and ``/api/generate`` share."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = Field(None, description='"json", or a JSON schema the answer follows')
    options: Options | None = None
    keep_alive: str | int | float | None = Field(None, description=KEEP_ALIVE)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    segfuse: dict[str, Any] | None = Field(None, description="segfuse options, as on chat completions")


class ChatRequest(OllamaRequest):
    """The body of ``POST /api/chat``; no messages: load the model (with ``keep_alive`` 0: unload it)."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(OllamaRequest):
    """The body of ``POST /api/generate``; no prompt: load the model (with ``keep_alive`` 0: unload it)."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False  # the prompt as it is, without the members' chat templates


class ShowRequest(BaseModel):
    """The body of ``POST /api/show`` (``name``: the older spelling of ``model``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    name: str | None = None
    verbose: bool = False


# Ollama fields segfuse does not implement, accepted at a value that asks for nothing (null for every one).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "think": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "images": ([],),
    "suffix": ("",),
    "template": ("",),
    "context": ([],),
    "width": (),
    "height": (),
    "steps": (),
}
CHAT_PARAMETERS: tuple[str, ...] = tuple(ChatRequest.model_fields)
GENERATE_PARAMETERS: tuple[str, ...] = tuple(GenerateRequest.model_fields)
# Why each neutral field is refused at any other value: said in the 400, so a client knows what to send.
REFUSALS: dict[str, str] = {
    "think": "the members do not think aloud: send think false or leave it out",
    "logprobs": "log-probabilities are on /v1/chat/completions (logprobs: true), not on Ollama's API",
    "top_logprobs": "log-probabilities are on /v1/chat/completions (top_logprobs), not on Ollama's API",
    "images": "no member reads images: send text only",
    "suffix": "fill-in-the-middle is not supported: send the text before the gap as the prompt",
    "template": "each member reads its own chat template: leave template out, or send raw: true",
    "context": "the context of an earlier answer is not kept: send the conversation to /api/chat",
    "width": "image generation is not supported",
    "height": "image generation is not supported",
    "steps": "image generation is not supported",
}


def error_body(error: APIError) -> dict[str, Any]:
    """An error in Ollama's shape, ``{"error": message}``."""
    return {"error": error.detail.message}


__all__ = [
    "CHAT_PARAMETERS",
    "CHAT_PATH",
    "GENERATE_PARAMETERS",
    "GENERATE_PATH",
    "IGNORED_OPTIONS",
    "LATEST",
    "NEUTRAL",
    "OLLAMA_VERSION",
    "PREFIX",
    "REFUSALS",
    "ChatRequest",
    "GenerateRequest",
    "OllamaMessage",
    "OllamaRequest",
    "OllamaToolCall",
    "Options",
    "ShowRequest",
    "error_body",
]
