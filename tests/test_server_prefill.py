"""Assistant prefill through the server, with the real SDKs: chat completions (`openai`, vLLM's
``continue_final_message`` / ``add_generation_prompt``), Anthropic's Messages (`anthropic`) and OpenAI's
Responses continue a final assistant message; the answer is the continuation, streamed as any answer, and a
JSON schema or a tool call holds for the prefill and the answer together."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from helpers import PERSON, PERSON_FORMAT
from live_app import KEY, LEADER, WEATHER, weather_call

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

PREFILL = '{"name":'
ASK = "Extract the person as JSON: Maria Lopez, 34, lives in Seville."
CONTINUED = [{"role": "user", "content": ASK}, {"role": "assistant", "content": PREFILL}]


@pytest.fixture(scope="module")
def server(uncached_server):
    return uncached_server


def refused(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.api}/{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert response.status_code == 400, response.text
    return response.json()["error"]


# --------------------------------------------------------------------------- chat completions


def test_chat_continues_the_prefill_under_a_json_schema_streamed_as_whole(openai_client):
    whole = openai_client.chat.completions.create(
        model="segfuse", messages=CONTINUED, max_tokens=48, response_format=PERSON_FORMAT
    )
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop" and not text.startswith(PREFILL)
    jsonschema.validate(json.loads(PREFILL + text), PERSON)
    chunks = openai_client.chat.completions.create(
        model="segfuse", messages=CONTINUED, max_tokens=48, response_format=PERSON_FORMAT, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # vLLM's way of asking for the same: the same answer
    vllm = openai_client.chat.completions.create(
        model="segfuse",
        messages=CONTINUED,
        max_tokens=48,
        response_format=PERSON_FORMAT,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert vllm.choices[0].message.content == text


def test_a_free_prefill_is_continued_and_streams_as_any_answer(openai_client):
    messages = [
        {"role": "user", "content": "Count from one to ten in words."},
        {"role": "assistant", "content": "One, two,"},
    ]
    whole = openai_client.chat.completions.create(model=LEADER, messages=messages, max_tokens=12)
    text = whole.choices[0].message.content
    assert text.strip() and whole.usage.completion_tokens <= 12
    chunks = list(openai_client.chat.completions.create(model=LEADER, messages=messages, max_tokens=12, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    fresh = openai_client.chat.completions.create(model=LEADER, messages=messages[:1], max_tokens=12)
    assert whole.usage.prompt_tokens > fresh.usage.prompt_tokens  # the prefill was read


def test_with_tools_auto_a_prefill_that_starts_a_call_is_answered_with_the_call(openai_client):
    tool = {
        "type": "function",
        "function": {
            "name": WEATHER["name"],
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        },
    }
    messages = [{"role": "user", "content": "What is the weather in Paris?"}, {"role": "assistant", "content": PREFILL}]
    answer = openai_client.chat.completions.create(model=LEADER, messages=messages, max_tokens=48, tools=[tool])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["input_schema"])


@pytest.mark.parametrize(
    "messages, extra, param, says",
    [
        (CONTINUED, {"continue_final_message": False}, "continue_final_message", "new assistant turn"),
        (CONTINUED, {"add_generation_prompt": True}, "add_generation_prompt", "new assistant turn"),
        (
            CONTINUED,
            {"continue_final_message": True, "add_generation_prompt": True},
            "add_generation_prompt",
            "new assistant turn",
        ),
        (CONTINUED[:1], {"continue_final_message": True}, "continue_final_message", "which is from the user"),
        (CONTINUED[:1], {"add_generation_prompt": False}, "add_generation_prompt", "which is from the user"),
        ([CONTINUED[0], {"role": "assistant", "content": '{"name": '}], {}, "messages", "ends with whitespace"),
        (
            [CONTINUED[0], {"role": "assistant", "content": "Sure!"}],
            {"response_format": PERSON_FORMAT},
            "messages",
            "cannot begin an answer",
        ),
        (
            [
                CONTINUED[0],
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
            ],
            {},
            "messages",
            "ends with the assistant's tool call",
        ),
    ],
    ids=[
        "continue-false",
        "generation-prompt",
        "both-true",
        "continue-a-user",
        "no-prompt-after-a-user",
        "trailing-space",
        "grammar-refuses",
        "a-tool-call",
    ],
)
def test_contradictory_or_bad_prefills_are_a_clear_400(server, messages, extra, param, says):
    error = refused(server, "chat/completions", {"messages": messages, "max_tokens": 4, **extra})
    assert error["param"] == param and says in error["message"], error


def test_the_neutral_vllm_fields_pass_on_a_plain_question(openai_client):
    answer = openai_client.chat.completions.create(
        model=LEADER,
        messages=CONTINUED[:1],
        max_tokens=4,
        extra_body={"continue_final_message": False, "add_generation_prompt": True},
    )
    assert answer.choices[0].message.content


# --------------------------------------------------------------------------- Anthropic's Messages


def test_messages_continue_the_prefill_streamed_as_whole(anthropic_client):
    body = {"model": LEADER, "max_tokens": 24, "system": "Answer with JSON only.", "messages": CONTINUED}
    message = anthropic_client.messages.create(**body)
    text = message.content[0].text
    assert message.content[0].type == "text" and text and not text.startswith(PREFILL)
    with anthropic_client.messages.stream(**body) as stream:
        assert "".join(stream.text_stream) == text


def test_messages_a_tool_call_written_from_the_prefill(anthropic_client):
    """The tools' answer is a call ``{"name": ..., "arguments": ...}``: a prefill begins it, and the call read
    from the prefill and the answer validates against the tool's schema."""
    weather_call(
        anthropic_client,
        [{"role": "user", "content": "What is the weather in Paris?"}, {"role": "assistant", "content": PREFILL}],
    )


def test_messages_refuse_a_prefill_ending_in_whitespace_in_anthropic_shape(anthropic_client):
    with pytest.raises(anthropic.BadRequestError, match="ends with whitespace"):
        anthropic_client.messages.create(
            model=LEADER, max_tokens=4, messages=[CONTINUED[0], {"role": "assistant", "content": "Sure, "}]
        )


# --------------------------------------------------------------------------- OpenAI's Responses


def test_responses_continue_an_input_that_ends_with_an_assistant_message(server, openai_client):
    body = {
        "model": LEADER,
        "max_output_tokens": 48,
        "input": [
            {"role": "user", "content": ASK},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": PREFILL}]},
        ],
        "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    }
    response = openai_client.responses.create(**body)
    assert response.status == "completed" and not response.output_text.startswith(PREFILL)
    jsonschema.validate(json.loads(PREFILL + response.output_text), PERSON)
    events = list(openai_client.responses.create(**body, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    # kept as one assistant turn, the prefill and the answer, for a later response to continue
    stored = server.state.extras["responses"].get(response.id)
    assert stored[-1] == {"role": "assistant", "content": PREFILL + response.output_text}
    assert [m["role"] for m in stored] == ["user", "assistant"]
