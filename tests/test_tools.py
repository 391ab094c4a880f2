"""Tool calls as pure logic: the tools offered, what the answer may be, and reading a call back."""

from __future__ import annotations

import json

import pytest

from segfuse.constraints import TextMatcher
from segfuse.errors import InvalidRequestError
from segfuse.tools import chosen_tools, parse_tools, read_call, render, tool_constraint
from segfuse.types import Message

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def test_required_means_a_call_of_one_of_the_tools():
    tools = parse_tools([WEATHER, CLOCK])
    matcher = TextMatcher(tool_constraint(*chosen_tools(tools, "required")))
    assert matcher.allows("", CALL) and matcher.complete(CALL)
    assert matcher.complete('{"name": "get_time", "arguments": {}}')
    assert not matcher.allows("", '{"name": "get_weather", "arguments": {"town"')  # not its parameter
    assert not matcher.allows("", "It is sunny")


def test_a_named_choice_allows_that_tool_only():
    tools, mode = chosen_tools(parse_tools([WEATHER, CLOCK]), {"type": "function", "function": {"name": "get_time"}})
    assert [t.name for t in tools] == ["get_time"] and mode == "required"
    assert not TextMatcher(tool_constraint(tools, mode)).allows("", '{"name": "get_w')


def test_auto_allows_a_call_or_text():
    tools, mode = chosen_tools(parse_tools([WEATHER]), None)
    matcher = TextMatcher(tool_constraint(tools, mode))
    assert mode == "auto" and matcher.complete(CALL) and matcher.complete("Hello Ada, nice to meet you.")
    assert not matcher.allows("", '{"not": "a call"}')


def test_none_offers_nothing():
    tools, mode = chosen_tools(parse_tools([WEATHER]), "none")
    assert tools == [] and mode == "none" and tool_constraint(tools, mode) is None
    assert render([Message("user", "hi")], tools, mode) == [Message("user", "hi")]


def test_the_tools_are_noted_in_the_system_message():
    tools = parse_tools([WEATHER])
    rendered = render([Message("system", "Be brief."), Message("user", "hi")], tools, "auto")
    assert rendered[0].role == "system" and rendered[0].content.startswith("Be brief.")
    assert "get_weather" in rendered[0].content and '"city"' in rendered[0].content
    assert render([Message("user", "hi")], tools, "auto")[0].role == "system"  # added when there is none


def test_a_call_is_read_back_with_json_arguments():
    call = read_call(CALL, parse_tools([WEATHER]))
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")
    assert read_call("It is sunny.", parse_tools([WEATHER])) is None
    assert read_call('{"name": "other", "arguments": {}}', parse_tools([WEATHER])) is None


@pytest.mark.parametrize(
    "tools, choice, words",
    [
        ([{"type": "function", "function": {"description": "x"}}], None, "name"),
        ([{"type": "retrieval"}], None, "function"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}], None, "JSON schema"),
        ([WEATHER, WEATHER], None, "share a name"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([], "required", "needs tools"),
    ],
)
def test_bad_tools_are_the_callers_error(tools, choice, words):
    with pytest.raises(InvalidRequestError) as caught:
        chosen_tools(parse_tools(tools), choice)
    assert words in caught.value.message
