"""What one request may cost: checks of a parsed request against the ``[limits]`` section.

Every check runs before the expensive part it protects (schema compilation, tool rendering, the
members), walks its input without recursion, and refuses with a 400 ``limit_exceeded`` whose
``param`` names the field and whose message names the limit and its setting.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..config import LimitsSection
from .serving import APIError


def exceeded(param: str, what: str, limit: int | float, setting: str) -> APIError:
    """400 naming the field and the limit (and where an operator changes it)."""
    return APIError(
        400,
        f"{param}: {what}; this server takes at most {limit:,} ([limits] {setting})",
        code="limit_exceeded",
        param=param,
    )


def depth(value: Any, stop_at: int) -> int:
    """How deeply objects and arrays nest in `value` (a scalar: 0), counted up to `stop_at` + 1."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, level)
        if deepest > stop_at:
            return deepest
        stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON (what a schema or a tool costs to compile and to show)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def check_body_depth(data: Any, limits: LimitsSection) -> None:
    """A body nested deeper than ``max_json_depth``: 400 naming the top-level field that holds the nesting."""
    if not isinstance(data, dict):
        return
    for name, value in data.items():
        if depth(value, limits.max_json_depth - 1) > limits.max_json_depth - 1:
            raise exceeded(name, "objects and arrays nest too deeply", limits.max_json_depth, "max_json_depth")


def check_schema(schema: Any, param: str, limits: LimitsSection) -> None:
    """One JSON schema (response_format's, a tool's parameters): its size and nesting."""
    if depth(schema, limits.max_schema_depth) > limits.max_schema_depth:
        raise exceeded(param, "the schema nests too deeply", limits.max_schema_depth, "max_schema_depth")
    size = json_size(schema)
    if size > limits.max_schema_bytes:
        raise exceeded(param, f"the schema is {size:,} bytes of JSON", limits.max_schema_bytes, "max_schema_bytes")


def check_stops(stops: str | Iterable[Any] | None, param: str, limits: LimitsSection) -> None:
    """Stop strings, wherever they come from (``stop``, ``segfuse.stop``): how many and how long."""
    if stops is None:
        return
    items = [stops] if isinstance(stops, str) else list(stops)
    if len(items) > limits.max_stops:
        raise exceeded(param, f"{len(items):,} stop strings", limits.max_stops, "max_stops")
    longest = max((len(s) for s in items if isinstance(s, str)), default=0)
    if longest > limits.max_stop_chars:
        raise exceeded(param, f"a stop string of {longest:,} characters", limits.max_stop_chars, "max_stop_chars")


def check_budget(value: Any, param: str, limits: LimitsSection) -> None:
    """An answer budget above ``max_tokens`` (refused, not clamped: the client learns the server's limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_tokens:
        raise exceeded(param, f"{value:,} tokens asked for", limits.max_tokens, "max_tokens")


def check_generation(request: Any, limits: LimitsSection) -> None:
    """What chat and text completions share: answer budgets and stop strings, top level and ``segfuse``."""
    check_budget(request.max_tokens, "max_tokens", limits)
    check_stops(request.stop, "stop", limits)
    extension = request.segfuse or {}
    check_budget(extension.get("max_tokens"), "segfuse.max_tokens", limits)
    stops = extension.get("stop")
    if isinstance(stops, str | list | tuple):
        check_stops(stops, "segfuse.stop", limits)


def check_chat(request: Any, limits: LimitsSection) -> None:
    """A chat request: messages, their contents, tools and the response format."""
    check_generation(request, limits)
    check_budget(request.max_completion_tokens, "max_completion_tokens", limits)
    if len(request.messages) > limits.max_messages:
        raise exceeded("messages", f"{len(request.messages):,} messages", limits.max_messages, "max_messages")
    chars = sum(len(m.text()) for m in request.messages)
    if chars > limits.max_content_chars:
        raise exceeded("messages", f"{chars:,} characters of content", limits.max_content_chars, "max_content_chars")
    tools = request.tools or []
    if len(tools) > limits.max_tools:
        raise exceeded("tools", f"{len(tools):,} tools", limits.max_tools, "max_tools")
    if tools:
        size = json_size(tools)
        if size > limits.max_tools_bytes:
            raise exceeded("tools", f"the tools are {size:,} bytes of JSON", limits.max_tools_bytes, "max_tools_bytes")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and function.get("parameters") is not None:
                check_schema(function["parameters"], f"tools[{i}].function.parameters", limits)
    spec = request.response_format
    inner = spec.get("json_schema") if isinstance(spec, dict) else None
    if isinstance(inner, dict) and "schema" in inner:
        check_schema(inner["schema"], "response_format", limits)


def check_text(request: Any, limits: LimitsSection) -> None:
    """A text completion: how many prompts and how long."""
    check_generation(request, limits)
    prompts = request.prompts
    if len(prompts) > limits.max_prompts:
        raise exceeded("prompt", f"{len(prompts):,} prompts", limits.max_prompts, "max_prompts")
    chars = sum(len(p) for p in prompts)
    if chars > limits.max_content_chars:
        raise exceeded("prompt", f"{chars:,} characters of prompt", limits.max_content_chars, "max_content_chars")


__all__ = [
    "check_body_depth",
    "check_chat",
    "check_schema",
    "check_stops",
    "check_text",
    "depth",
    "exceeded",
    "json_size",
]
