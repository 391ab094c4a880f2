"""Anthropic's Messages API, driven by the real `anthropic` SDK against a live server with the embedded
members: create, stream, a tool round trip, count_tokens, and bad input answered in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from helpers import wait_for
from live_app import KEY, LEADER, WEATHER, idle, weather_call

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(uncached_server):
    return uncached_server


def post(server, body, key: str | None = KEY, path: str = "/v1/messages") -> httpx.Response:
    headers = {"x-api-key": key} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=300)


def anthropic_error(response: httpx.Response, status: int, kind: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]


def test_create_and_stream_give_the_same_answer(anthropic_client):
    message = anthropic_client.messages.create(model=LEADER, max_tokens=8, system="Be brief.", messages=HI)
    assert message.type == "message" and message.role == "assistant" and message.model == LEADER
    text = message.content[0].text
    assert text.strip() and message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 8
    with anthropic_client.messages.stream(model=LEADER, max_tokens=8, system="Be brief.", messages=HI) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens


def test_the_fused_model_answers_with_its_extension(anthropic_client):
    message = anthropic_client.messages.create(model="segfuse", max_tokens=6, messages=HI)
    info = message.model_extra["segfuse"]
    assert len(info["members"]) == 3 and "".join(s["text"] for s in info["segments"]) == message.content[0].text


def test_a_tool_round_trip(anthropic_client):
    first = weather_call(anthropic_client, [{"role": "user", "content": "What is the weather in Paris?"}])
    call = first.content[0]
    second = anthropic_client.messages.create(
        model=LEADER,
        max_tokens=12,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
        ],
    )
    assert second.content[0].type == "text" and second.content[0].text.strip()
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result were read


def test_a_streamed_tool_call(anthropic_client):
    with anthropic_client.messages.stream(
        model=LEADER,
        max_tokens=48,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_weather"
    jsonschema.validate(final.content[0].input, WEATHER["input_schema"])


def test_count_tokens_is_the_prompt_the_answer_reads(anthropic_client):
    counted = anthropic_client.messages.count_tokens(model=LEADER, system="Be brief.", messages=HI)
    message = anthropic_client.messages.create(model=LEADER, max_tokens=1, system="Be brief.", messages=HI)
    assert counted.input_tokens == message.usage.input_tokens > 0
    with_tools = anthropic_client.messages.count_tokens(model=LEADER, messages=HI, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def test_bad_input_is_refused_in_anthropic_shape(server, anthropic_client):
    missing = anthropic_error(post(server, {"model": LEADER, "messages": HI}), 400)
    assert missing["param"] == "max_tokens"
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]
    assert (
        "'image' is not supported"
        in anthropic_error(post(server, {"model": LEADER, "max_tokens": 4, "messages": image}), 400)["message"]
    )
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]
    assert (
        "toolu_x"
        in anthropic_error(post(server, {"model": LEADER, "max_tokens": 4, "messages": orphan}), 400)["message"]
    )
    anthropic_error(
        post(server, {"model": LEADER, "max_tokens": 4, "messages": HI}, key="wrong"), 401, "authentication_error"
    )
    anthropic_error(post(server, {"model": "claude-x", "max_tokens": 4, "messages": HI}), 404, "not_found_error")
    assert (
        anthropic_error(post(server, {"model": LEADER, "max_tokens": 4, "messages": HI, "top_k": 5}), 400)["param"]
        == "top_k"
    )
    assert (
        anthropic_error(
            post(server, {"model": LEADER, "max_tokens": 4, "messages": HI, "tool_choice": {"type": "maybe"}}), 400
        )["param"]
        == "tool_choice"
    )
    # [limits] apply, named by their Anthropic fields
    assert (
        anthropic_error(post(server, {"model": LEADER, "max_tokens": 10_000, "messages": HI}), 400)["code"]
        == "limit_exceeded"
    )
    assert (
        anthropic_error(
            post(
                server, {"model": LEADER, "max_tokens": 4, "messages": HI, "stop_sequences": ["a", "b", "c", "d", "e"]}
            ),
            400,
        )["param"]
        == "stop_sequences"
    )
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model=LEADER, max_tokens=4, messages=[])
    # still serving, nothing held
    assert anthropic_client.messages.create(model=LEADER, max_tokens=2, messages=HI).content
    wait_for(lambda: idle(server.state), 60, what="no request or slot held")


def test_models_say_their_context_length(server):
    listed = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).json()["data"]
    cards = {card["id"]: card for card in listed}
    members = cards["segfuse"]["members"]
    assert len(members) == 3 and all(cards[m]["parent"] == "segfuse" for m in members)
    windows = [cards[m]["context_length"] for m in members]
    assert all(isinstance(n, int) and n > 0 for n in windows)
    assert cards["segfuse"]["context_length"] == min(windows) == cards["segfuse"]["max_model_len"]
    one = httpx.get(f"{server.url}/v1/models/{LEADER}", headers={"x-api-key": KEY}).json()
    assert one["context_length"] == cards[LEADER]["context_length"]


def test_hostile_bodies_get_anthropic_errors_and_a_hangup_frees_the_job(server, anthropic_client):
    raw = {"x-api-key": KEY, "Content-Type": "application/json"}
    bad_json = httpx.post(f"{server.url}/v1/messages", content=b"{not json", headers=raw, timeout=60)
    assert anthropic_error(bad_json, 400)["code"] == "invalid_json"
    as_form = httpx.post(
        f"{server.url}/v1/messages", content=b"{}", timeout=60, headers={**raw, "Content-Type": "text/plain"}
    )
    assert anthropic_error(as_form, 415)["code"] == "unsupported_media_type"
    huge = {"model": LEADER, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 3_000_000}]}
    anthropic_error(post(server, huge), 413, "request_too_large")
    surrogate = (
        b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}' % LEADER.encode()
    )
    assert (
        anthropic_error(httpx.post(f"{server.url}/v1/messages", content=surrogate, headers=raw, timeout=60), 400)[
            "param"
        ]
        == "messages.0.content"
    )
    cancelled = server.state.worker.queue.snapshot()["cancelled"]
    body = {"model": "segfuse", "max_tokens": 64, "stream": True, "messages": HI}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers=raw, timeout=300) as response:
        for line in response.iter_lines():
            if line == "event: content_block_delta":
                break  # hang up mid-answer
    wait_for(lambda: server.state.worker.queue.snapshot()["cancelled"] > cancelled, 60, what="the job cancelled")
    wait_for(lambda: idle(server.state), 60, what="no request or slot held")
    assert anthropic_client.messages.create(model=LEADER, max_tokens=2, messages=HI).content
