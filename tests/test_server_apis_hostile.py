"""Hostile input on the Messages and Responses endpoints: every field of a valid body replaced by values of
every JSON kind (and a few unknown fields added). Each answer is a 200 or a 4xx in that API's own error
shape, never a 5xx; nothing fails in the worker and the server still serves."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from helpers import wait_for
from live_app import KEY, LEADER, idle, live

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

ODD: list[Any] = [None, -1, 1.5, "x", True, [], {"a": {"b": [None]}}]
TOOL = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
# Tools are mutated one at a time (``tool_variants``): a body that offers them costs a grammar per answer.
MESSAGES = {
    "model": LEADER,
    "max_tokens": 1,
    "system": "Be brief.",
    "stop_sequences": ["\n\n"],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
    "metadata": {"user_id": "u1"},
    "temperature": 0,
}
RESPONSES = {
    "model": LEADER,
    "max_output_tokens": 1,
    "instructions": "Be brief.",
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}],
    "text": {"format": {"type": "text"}},
    "temperature": 0,
    "store": False,
}
TOOLS = {
    "/v1/messages": {"name": "look", "description": "Look it up", "input_schema": TOOL},
    "/v1/responses": {"type": "function", "name": "look", "parameters": TOOL},
}


@pytest.fixture(scope="module")
def server(default_ensemble):
    with live(default_ensemble) as running:
        yield running


def variants(body: dict[str, Any], inner: str) -> list[dict[str, Any]]:
    """`body` with each top-level field, the first item of `inner` and that item's content set to each odd
    value, and with unknown fields added."""
    out = [{**body, name: value} for name in body for value in ODD]
    first = body[inner][0]
    out += [{**body, inner: [value]} for value in ODD]
    out += [{**body, inner: [{**first, key: value}]} for key in first for value in ODD]
    out += [{**body, "frobnicate": 1}, {**body, "logprobs": True}, {**body, inner: [first] * 3}]
    return out


def tool_variants(body: dict[str, Any], tool: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool list, a tool, each of its fields and tool_choice set to each odd value."""
    out = [{**body, "tools": [value]} for value in ODD if value is not None]
    out += [{**body, "tools": [{**tool, key: value}]} for key in tool for value in ODD]
    return out + [{**body, "tools": [tool], "tool_choice": value} for value in ODD if value is not None]


@pytest.mark.parametrize(
    ("path", "body", "inner"), [("/v1/messages", MESSAGES, "messages"), ("/v1/responses", RESPONSES, "input")]
)
def test_every_mutation_is_answered_in_the_apis_shape(server, path, body, inner):
    headers = {"x-api-key": KEY} if path == "/v1/messages" else {"Authorization": f"Bearer {KEY}"}
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, headers=headers, timeout=300) as client:
        for mutated in variants(body, inner) + tool_variants(body, TOOLS[path]):
            response = client.post(path, content=json.dumps(mutated), headers={"Content-Type": "application/json"})
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (mutated, response.text)
            if response.status_code == 200:
                continue
            error = response.json()
            if path == "/v1/messages":
                assert error["type"] == "error" and error["error"]["type"] and error["error"]["message"], error
            else:
                assert error["error"]["message"] and error["error"]["type"], error
    assert statuses.get(200) and sum(n for s, n in statuses.items() if 400 <= s < 500) > 50, statuses
    assert server.state.worker.queue.snapshot()["failed"] == 0
    wait_for(lambda: idle(server.state), 60, what="no request or slot held")
    assert httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=300).status_code == 200
