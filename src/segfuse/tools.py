"""Tool calls: the tools a request offers, how members see them, what the answer may be, and reading a call back.

Every member sees the tools in a plain rendering (its chat template is not asked to know tools): a
system note lists each tool with its JSON schema and says how to call one, an answer of exactly
``{"name": ..., "arguments": {...}}``. Earlier calls in the conversation are rendered the same way as the
assistant's turn, and tool results as a user turn that names the call. The answer is then constrained
(``constraints.py``), so a call is always well formed and its arguments validate:

- ``tool_choice`` "required" (or a named function): the answer is a call (of that function);
- "auto": a call, or free text that does not start with ``{``;
- "none": the tools are not offered.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .constraints import JSON_OPTIONS, Constraint, _check_schema
from .errors import InvalidRequestError
from .types import Message

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of a call of this tool: its name and arguments that validate."""
        return {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {"name": {"const": self.name}, "arguments": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


def parse_tools(specs: Sequence[Any], where: str = "tools") -> list[Tool]:
    """OpenAI ``tools`` -> Tools; a clear InvalidRequestError naming the field otherwise."""
    tools: list[Tool] = []
    for i, spec in enumerate(specs):
        at = f"{where}[{i}]"
        if (
            not isinstance(spec, Mapping)
            or spec.get("type") != "function"
            or not isinstance(spec.get("function"), Mapping)
        ):
            raise InvalidRequestError(
                f'{at} must be {{"type": "function", "function": {{...}}}}', "only function tools are supported"
            )
        function = spec["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequestError(
                f"{at}.function.name must be 1-64 letters, digits, _ or -, got {name!r}", "give every tool a name"
            )
        parameters = function.get("parameters") or NO_PARAMETERS
        if not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"{at}.function.parameters must be a JSON schema object", "see the OpenAI docs")
        _check_schema(dict(parameters), f"{at}.function.parameters")
        tools.append(Tool(name, str(function.get("description") or ""), dict(parameters)))
    if len({t.name for t in tools}) != len(tools):
        raise InvalidRequestError(f"{where}: two tools share a name", "give each tool its own name")
    return tools


def chosen_tools(tools: Sequence[Tool], choice: Any) -> tuple[list[Tool], str]:
    """(the tools offered, mode "none" | "auto" | "required") for a ``tool_choice``."""
    if choice is None:
        return (list(tools), "auto") if tools else ([], "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools", "pass tools or drop tool_choice")
        return (list(tools), choice) if choice != "none" else ([], "none")
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
    named = [t for t in tools if t.name == name]
    if not named:
        raise InvalidRequestError(
            f"tool_choice names {name!r}, which is not among the tools",
            f"tools: {', '.join(t.name for t in tools) or 'none'}",
        )
    return named, "required"


def tool_constraint(tools: Sequence[Tool], mode: str) -> Constraint | None:
    """What the answer may be: a call (required), a call or text not starting with '{' (auto), anything (none)."""
    if mode == "none" or not tools:
        return None
    calls = {"anyOf": [t.call_schema() for t in tools]} if len(tools) > 1 else tools[0].call_schema()
    if mode == "required":
        return Constraint.json_schema(calls, where="tools")
    schema = {**calls, "x-guidance": JSON_OPTIONS}
    return Constraint.lark(f"start: call | TEXT\ncall: %json {json.dumps(schema)}\nTEXT: /[^{{](.|\\n)*/\n")


def tools_note(tools: Sequence[Tool], mode: str) -> str:
    """The plain rendering of the tools, for the system message."""
    lines = ["You can call these tools:"]
    lines += [
        f"- {tool.name}: {tool.description or '(no description)'} "
        f"Arguments (JSON schema): {json.dumps(tool.parameters)}"
        for tool in tools
    ]
    how = 'To call a tool, answer with only a JSON object: {"name": "<tool name>", "arguments": {...}}.'
    if mode == "required":
        how += " You must call a tool now."
    else:
        how += (
            " Call a tool only for information you do not have yet: once a tool's result is in the "
            "conversation, use it and answer the user in plain text."
        )
    return "\n".join([*lines, how])


def render(messages: Sequence[Message], tools: Sequence[Tool], mode: str) -> list[Message]:
    """The conversation with the tools noted in the system message (added first when there is none)."""
    if mode == "none" or not tools:
        return list(messages)
    note = tools_note(tools, mode)
    if messages and messages[0].role == "system":
        return [Message("system", f"{messages[0].content}\n\n{note}"), *messages[1:]]
    return [Message("system", note), *messages]


def call_text(name: str, arguments: str) -> str:
    """An earlier call, as the assistant's turn: the JSON the model would have answered."""
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        parsed = arguments
    return json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False)


def result_text(name: str | None, call_id: str | None, content: str) -> str:
    """A tool's result, as the user turn that follows the call."""
    who = f"{name} ({call_id})" if name and call_id else name or call_id or "the tool"
    return f"Result of {who}:\n{content}\n\nUse this result to answer my question."


def read_call(text: str, tools: Sequence[Tool]) -> ToolCall | None:
    """The call an answer makes (None: the answer is text)."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in {t.name for t in tools}:
        return None
    arguments = json.dumps(value.get("arguments") or {}, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], arguments)


__all__ = [
    "Tool",
    "ToolCall",
    "call_text",
    "chosen_tools",
    "parse_tools",
    "read_call",
    "render",
    "result_text",
    "tool_constraint",
]
