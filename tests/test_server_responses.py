"""OpenAI's Responses API, driven by the real `openai` SDK against a live server with the embedded
members: text, stream, a function-call round trip, json_schema, previous_response_id, and bad input."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from helpers import wait_for
from live_app import KEY, LEADER, idle

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
NUMBER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(uncached_server):
    return uncached_server


def refused(server, body, status: int = 400) -> dict:
    response = httpx.post(f"{server.api}/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_text_and_stream_give_the_same_answer(openai_client):
    response = openai_client.responses.create(
        model=LEADER, instructions="Be brief.", input="Say hi.", max_output_tokens=8, temperature=0
    )
    assert response.object == "response" and response.output_text.strip()
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens <= 8
    events = list(
        openai_client.responses.create(
            model=LEADER, instructions="Be brief.", input="Say hi.", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].response.output_text == response.output_text


def test_a_function_call_round_trip(openai_client):
    first = openai_client.responses.create(
        model=LEADER,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=48,
        temperature=0,
    )
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = openai_client.responses.create(
        model=LEADER,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=12,
        temperature=0,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
    )
    assert second.output[0].type == "message" and second.output_text.strip()
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_streamed_function_call(openai_client):
    events = list(
        openai_client.responses.create(
            model=LEADER,
            input="Weather in Oslo?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=48,
            temperature=0,
            stream=True,
        )
    )
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == arguments


def test_json_schema_answers_parse(openai_client):
    response = openai_client.responses.create(
        model=LEADER,
        input="Pick a number.",
        max_output_tokens=24,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "n", "schema": NUMBER, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), NUMBER)


def test_previous_response_id_continues_a_stored_conversation(server, openai_client):
    first = openai_client.responses.create(model=LEADER, input="My name is Ada.", max_output_tokens=4, temperature=0)
    second = openai_client.responses.create(
        model=LEADER, input="And yours?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    alone = openai_client.responses.create(model=LEADER, input="And yours?", max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id and second.usage.input_tokens > alone.usage.input_tokens
    unstored = openai_client.responses.create(model=LEADER, input="Hi.", store=False, max_output_tokens=2)
    error = refused(server, {"model": LEADER, "input": "Hi.", "previous_response_id": unstored.id})
    assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"


def test_bad_input_is_refused_in_openai_shape(server, openai_client):
    assert (
        refused(server, {"model": LEADER, "input": [{"type": "input_image", "image_url": "x"}]})["param"] == "input.0"
    )
    orphan = [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]
    assert "call_x" in refused(server, {"model": LEADER, "input": orphan})["message"]
    assert (
        refused(server, {"model": LEADER, "input": "Hi.", "tools": [{"type": "web_search"}]})["param"] == "tools.0.type"
    )
    assert refused(server, {"model": LEADER, "input": "Hi.", "reasoning": {"effort": "high"}})["param"] == "reasoning"
    assert (
        refused(server, {"model": LEADER, "input": "Hi.", "text": {"format": {"type": "yaml"}}})["param"]
        == "text.format"
    )
    assert refused(server, {"input": "Hi.", "max_output_tokens": 10_000})["code"] == "limit_exceeded"
    assert refused(server, {"model": "gpt-x", "input": "Hi."}, 404)["code"] == "model_not_found"
    assert refused(server, {"model": LEADER}, 422)["param"] == "input"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.api, api_key="wrong", max_retries=0).responses.create(model=LEADER, input="x")
    assert openai_client.responses.create(model=LEADER, input="Hi.", max_output_tokens=2).output_text  # still serving
    wait_for(lambda: idle(server.state), 60, what="no request or slot held")


def test_a_hangup_mid_stream_frees_the_job(server, openai_client):
    cancelled = server.state.worker.queue.snapshot()["cancelled"]
    body = {"model": "segfuse", "input": "Tell me a story.", "max_output_tokens": 64, "stream": True}
    with httpx.stream(
        "POST", f"{server.api}/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300
    ) as response:
        for line in response.iter_lines():
            if line == "event: response.output_text.delta":
                break  # hang up mid-answer
    wait_for(lambda: server.state.worker.queue.snapshot()["cancelled"] > cancelled, 60, what="the job cancelled")
    wait_for(lambda: idle(server.state), 60, what="no request or slot held")
    assert openai_client.responses.create(model=LEADER, input="Hi.", max_output_tokens=2).output_text


def test_the_store_is_bounded_in_responses_and_characters():
    from segfuse.server.responses.store import ResponseStore

    def turn(chars: int) -> list[dict]:
        return [{"role": "user", "content": "x" * chars}]

    store = ResponseStore(capacity=3, max_chars=100)
    for i in range(4):
        store.put(f"r{i}", turn(10))
    assert store.get("r0") is None and len(store) == 3  # the oldest went first
    assert store.get("r1") is not None  # now the most recently used
    store.put("big", turn(75))  # 4 responses, 105 characters: the least recently used goes
    assert store.get("r2") is None and store.get("r3") is not None and store.get("r1") is not None
    assert store.chars == 95 and len(store) == 3
    store.put("more", turn(85))  # big is now the least recently used: it goes, then r3, for room
    assert store.get("big") is None and store.get("r3") is None and store.get("r1") is not None
    assert store.chars == 95 and len(store) == 2
    store.put("huge", turn(101))  # larger than the whole store: not kept, nothing dropped for it
    assert store.get("huge") is None and len(store) == 2
