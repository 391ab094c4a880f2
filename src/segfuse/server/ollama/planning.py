"""Ollama requests -> what the worker takes (``OllamaPlan``).

A chat, and a generate with its prompt templated, become the chat request they mean, planned as chat
plans it (``chat.planning.plan_of``): tools, ``format`` as structured output, limits and fusion options
behave as on the other APIs. A raw generate is a text completion (``completions.serving.requests_of``).
An empty request (no messages, no prompt) plans nothing: it loads or unloads the model. Everything here
raises ``serving.APIError`` naming the field as the client wrote it (``options.num_predict``, ``format``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ...config import LimitsSection
from ...request import FusionRequest
from ...tools import Tool
from .. import limits as checks
from .. import parsing
from ..chat.planning import plan_of
from ..chat.protocol import ChatCompletionRequest
from ..completions.protocol import CompletionRequest
from ..completions.serving import requests_of
from ..parsing import Defaults, Endpoint
from ..serving import APIError
from .protocol import (
    CHAT_PARAMETERS,
    GENERATE_PARAMETERS,
    IGNORED_OPTIONS,
    LATEST,
    NEUTRAL,
    REFUSALS,
    ChatRequest,
    GenerateRequest,
    OllamaMessage,
    OllamaRequest,
)

log = logging.getLogger("segfuse.server")
CHAT = Endpoint(ChatRequest, CHAT_PARAMETERS, NEUTRAL)
GENERATE = Endpoint(GenerateRequest, GENERATE_PARAMETERS, NEUTRAL)
# Our fields under the names an Ollama client wrote them, for the errors that name them.
OLLAMA_NAMES = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "seed": "options.seed",
    "stop": "options.stop",
    "response_format": "format",
    "prompt": "prompt",
}


@dataclass(frozen=True)
class OllamaPlan:
    """An Ollama request made ready: the generation it asks for (None: an empty request, which loads the
    model, or unloads it), the model it names (as the catalog names it) and the tools offered."""

    request: ChatRequest | GenerateRequest
    model: str | None
    fusion: FusionRequest | None
    tools: list[Tool]


def model_name(name: str | None, known: Mapping[str, object]) -> str | None:
    """The model a request names: Ollama's clients add ``:latest`` to a bare name, which is ours."""
    if name is not None and name not in known and name.endswith(LATEST) and name.removesuffix(LATEST) in known:
        return name.removesuffix(LATEST)
    return name


def parse(body: bytes, endpoint: Endpoint, limits: LimitsSection) -> Any:
    """The request, or a 400 (Ollama answers a bad shape with 400 too) saying what to send instead."""
    try:
        return parsing.parse_request(body, endpoint, limits)
    except APIError as exc:
        param = exc.detail.param
        if exc.detail.code == "unsupported_parameter" and param in REFUSALS:
            raise APIError(400, f"{param}: {REFUSALS[param]}", code="unsupported_parameter", param=param) from None
        exc.status = 400 if exc.status == 422 else exc.status
        raise


def _in_ollama_names(exc: APIError) -> APIError:
    """`exc` naming the field as the Ollama client wrote it."""
    ours = exc.detail.param
    theirs = OLLAMA_NAMES.get((ours or "").split(".")[0])
    if ours is None or theirs is None or ours.startswith(theirs):
        return exc
    message = exc.detail.message.replace("response_format.json_schema.schema", "format")
    if message.startswith(ours):
        message = theirs + message[len(ours) :]
    return APIError(exc.status, message, exc.detail.type, exc.detail.code, theirs)


def sampling(request: OllamaRequest) -> dict[str, Any]:
    """``options`` as our fields. num_predict -1 and -2 (no bound) take the server's budget; the options
    that do not apply are skipped (IGNORED_OPTIONS), others logged as Ollama logs them."""
    options = request.options
    if options is None:
        return {}
    unknown = sorted(set(options.model_extra or {}) - IGNORED_OPTIONS)
    if unknown:
        log.info("ignoring unknown Ollama options: %s", ", ".join(unknown)[:200])
    budget = options.num_predict if options.num_predict is not None and options.num_predict > 0 else None
    return {
        "max_tokens": budget,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "seed": options.seed,
        "stop": options.stop,
    }


def response_format(spec: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """``format`` as chat's ``response_format``: "json" any JSON object, a schema the answer follows."""
    if spec is None or spec == "":
        return None
    if spec == "json":
        return {"type": "json_object"}
    if isinstance(spec, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": spec}}
    raise APIError.invalid("format", f'{spec!r} is no format: send "json" or a JSON schema')


def chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as chat's: a call's arguments as JSON text, a tool's result tied to its call (by
    its id, else by the latest call of that tool)."""
    out: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # tool name -> the id of its latest call
    for i, m in enumerate(messages):
        if m.images:
            raise APIError.invalid(f"messages.{i}.images", REFUSALS["images"])
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "assistant" and m.tool_calls:
            made = []
            for j, call in enumerate(m.tool_calls):
                calls[call.function.name] = call.id or f"call_{i}_{j}"
                arguments = json.dumps(call.function.arguments, ensure_ascii=False)
                function = {"name": call.function.name, "arguments": arguments}
                made.append({"id": calls[call.function.name], "type": "function", "function": function})
            turn = {"role": "assistant", "content": m.content or None, "tool_calls": made}
        elif m.role == "tool":
            turn["tool_call_id"] = m.tool_call_id or calls.get(m.tool_name or "")
            turn["name"] = m.tool_name
        out.append({k: v for k, v in turn.items() if v is not None})
    return out


def to_chat(request: OllamaRequest, model: str | None, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request an Ollama chat or templated generate means."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        **sampling(request),
        "tools": getattr(request, "tools", None) or None,
        "response_format": response_format(request.format),
        "cache_salt": request.cache_salt,
        "segfuse": request.segfuse,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise _in_ollama_names(APIError.invalid(where, first["msg"])) from None


def _planned(
    request: ChatRequest | GenerateRequest,
    model: str | None,
    chat: ChatCompletionRequest,
    defaults: Defaults,
    limits: LimitsSection,
) -> OllamaPlan:
    try:
        checks.check_chat(chat, limits)
        plan = plan_of(chat, defaults, limits)
    except APIError as exc:
        raise _in_ollama_names(exc) from None
    return OllamaPlan(request, model, plan.fusion, plan.tools)


def plan_chat(body: bytes, defaults: Defaults, limits: LimitsSection) -> OllamaPlan:
    """``/api/chat``'s body -> its plan (CPU work on client input: run off the event loop)."""
    request: ChatRequest = parse(body, CHAT, limits)
    model = model_name(request.model, defaults.models)
    if not request.messages:
        return OllamaPlan(request, model, None, [])
    return _planned(request, model, to_chat(request, model, chat_messages(request.messages)), defaults, limits)


def plan_generate(body: bytes, defaults: Defaults, limits: LimitsSection) -> OllamaPlan:
    """``/api/generate``'s body -> its plan: the prompt as a user turn after ``system`` in each member's
    chat template, or with ``raw`` as it is."""
    request: GenerateRequest = parse(body, GENERATE, limits)
    model = model_name(request.model, defaults.models)
    if not request.prompt:
        return OllamaPlan(request, model, None, [])
    if request.raw:
        return OllamaPlan(request, model, raw_fusion(request, model, defaults, limits), [])
    system = [{"role": "system", "content": request.system}] if request.system else []
    messages = [*system, {"role": "user", "content": request.prompt}]
    return _planned(request, model, to_chat(request, model, messages), defaults, limits)


def raw_fusion(request: GenerateRequest, model: str | None, defaults: Defaults, limits: LimitsSection) -> FusionRequest:
    """A raw prompt, continued as a text completion continues one (no template, so no system turn and no
    format: the client writes the whole prompt)."""
    for field, given in (("system", request.system), ("format", request.format)):
        if given:
            raise APIError.invalid(field, "not with raw: true (the prompt is read as it is: write it into the prompt)")
    body = {"model": model, "prompt": request.prompt, **sampling(request), "cache_salt": request.cache_salt}
    body["segfuse"] = request.segfuse
    try:
        completion = CompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        checks.check_text(completion, limits)
        [fusion] = requests_of(completion, [request.prompt], defaults.of(model))
    except APIError as exc:
        raise _in_ollama_names(exc) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        raise _in_ollama_names(APIError.invalid(".".join(str(p) for p in first["loc"]), first["msg"])) from None
    return fusion


__all__ = ["CHAT", "GENERATE", "OllamaPlan", "model_name", "parse", "plan_chat", "plan_generate", "sampling"]
