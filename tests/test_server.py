"""`segfuse serve` with the real default members, driven by the real `openai` client and raw HTTP.

One server (a subprocess on a free loopback port) serves the whole module. Answers
are kept short (max_tokens 4-16) so the module stays quick on a 2-core CPU.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import openai
import pytest
from openai import OpenAI

from helpers import PERSON, PERSON_FORMAT, live_server, wait_for
from segfuse import models as catalogue

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

QUESTION = "What is the capital of France? Answer in one short sentence."
LONG = "Count from 1 to 300, separated by commas."
MEMBERS = list(catalogue.DEFAULT_MODELS)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = [n for n in MEMBERS if not catalogue.is_ready(catalogue.CATALOGUE[n])]
    if missing:
        pytest.fail(f"models not prepared: {missing}; run `make models`", pytrace=False)
    # No prefix cache: tests here compare a streamed greedy answer with a whole one, and a prompt
    # prefilled in another batch split (as a cache hit is) sums in another order, which can flip a near tie.
    with live_server(
        tmp_path_factory.mktemp("server"), queue_size=8, max_body_bytes=65536, prefix_cache_cells=0
    ) as running:
        yield running
        # Whatever the tests did, the server never crashed on a request.
        assert running.health()["counters"]["failed"] == 0, running.log_tail()
    assert running.process.returncode == 0, running.log_tail()  # Ctrl-C shuts down cleanly


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.api, api_key=server.api_key, max_retries=0, timeout=300)


def ask(client, **options):
    """The fused greedy answer to QUESTION in 12 tokens at most, with `options` (stream, stop, logprobs...)."""
    return client.chat.completions.create(
        model="segfuse", messages=user(QUESTION), max_tokens=12, temperature=0, **options
    )


@pytest.fixture(scope="module")
def greedy(client):
    """One greedy non-streaming answer, shared by the tests that inspect it."""
    return ask(client)


def ext(obj) -> dict:
    """The `segfuse` extension field of an openai response object."""
    return (obj.model_extra or {}).get("segfuse") or {}


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"message", "type", "param", "code"} <= set(error)
    return error


# --------------------------------------------------------------------------- happy paths


def test_models_and_health(client, server):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"segfuse", *MEMBERS}
    assert cards["segfuse"].model_extra["members"] == MEMBERS
    assert all(cards[m].model_extra["parent"] == "segfuse" for m in MEMBERS)
    health = server.health()
    assert health["status"] == "ok" and health["members"] == MEMBERS
    assert health["queue"] == {"waiting": 0, "running": 0, "capacity": 8, "max_concurrent": 2}
    assert client.models.retrieve("segfuse").id == "segfuse"


def test_non_streaming_completion_with_provenance(greedy):
    choice = greedy.choices[0]
    text = choice.message.content
    assert greedy.object == "chat.completion" and greedy.model == "segfuse"
    assert choice.message.role == "assistant" and text.strip()
    assert choice.finish_reason in ("stop", "length")
    usage = greedy.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    info = ext(greedy)
    assert info["members"] == MEMBERS
    assert "".join(s["text"] for s in info["segments"]) == text
    assert all(s["model"] in MEMBERS for s in info["segments"])
    stats = info["stats"]
    assert stats["tokens"] == usage.completion_tokens
    assert sum(stats["wins"].values()) == stats["rounds"] == len(info["rounds"])
    assert set(info["prompt_tokens"]) == set(MEMBERS) and usage.prompt_tokens == max(info["prompt_tokens"].values())
    for record in info["rounds"]:
        assert record["winner"] == record["candidates"][record["winner_index"]]["model"]
        assert [c["model"] for c in record["candidates"]] == record["active"]
        for verifier, row in record["scores"].items():
            assert verifier in MEMBERS and len(row) == len(record["candidates"])
            assert sum(row) == pytest.approx(1.0, abs=1e-6)


def test_streaming_reads_the_same_answer(client, greedy):
    stream = ask(client, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces, ended = [], 0
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            info = ext(chunk)
            # a delta per accepted segment, or per piece of one the leader writes alone (live.py), with its
            # author; a segment's last delta comes with the round that chose it
            assert info["segment"]["text"] == chunk.choices[0].delta.content
            assert info["segment"]["model"] in MEMBERS
            if "round" in info:
                ended += 1
                assert info["round"]["winner"] == info["segment"]["model"]
                # a round the leader won alone (confidence gate) has its one candidate; a vote has everyone's
                assert len(info["round"]["candidates"]) == (1 if info["round"]["gated"] else len(MEMBERS))
            pieces.append(chunk.choices[0].delta.content)
    # greedy decoding: the stream and the plain body come from the same engine iterator
    assert "".join(pieces) == greedy.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == greedy.choices[0].finish_reason
    assert ext(finishing[0])["stats"]["rounds"] >= ended >= 1
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == greedy.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_raw_sse_framing(http):
    """Role chunk first, `data: [DONE]` last; a raw body declared JSON (curl -H 'Content-Type: application/json')."""
    body = json.dumps(
        {"messages": user("Say hi."), "max_tokens": 4, "stream": True, "logprobs": False, "frequency_penalty": 0}
    )  # OpenAI parameters at their neutral values
    with http.stream(
        "POST", "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    first = json.loads(frames[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" not in json.loads(f[6:]) for f in frames[:-1])  # not asked for


def test_a_member_alone_is_a_model(client):
    answer = client.chat.completions.create(model="smollm2-135m", messages=user(QUESTION), max_tokens=6)
    info = ext(answer)
    assert answer.model == "smollm2-135m" and info["members"] == ["smollm2-135m"]
    assert {s["model"] for s in info["segments"]} <= {"smollm2-135m"}


# --------------------------------------------------------------------------- bad input

OK_MESSAGES = user("Hello")
BAD_REQUESTS = {
    "invalid JSON": (b'{"messages": [', 400, "invalid_json", None),
    "JSON array": (b"[1, 2]", 400, "invalid_json", None),
    "missing messages": ({"model": "segfuse"}, 422, "invalid_value", "messages"),
    "messages not a list": ({"messages": "hello"}, 422, "invalid_value", "messages"),
    "content not a string": ({"messages": [{"role": "user", "content": 5}]}, 422, "invalid_value", None),
    "unknown role": ({"messages": [{"role": "robot", "content": "hi"}]}, 422, "invalid_value", None),
    "max_tokens a string": ({"messages": OK_MESSAGES, "max_tokens": "ten"}, 422, "invalid_value", "max_tokens"),
    "stream a string": ({"messages": OK_MESSAGES, "stream": "yes"}, 422, "invalid_value", "stream"),
    "empty messages": ({"messages": []}, 422, "invalid_value", "messages"),
    "max_tokens 0": ({"messages": OK_MESSAGES, "max_tokens": 0}, 422, "invalid_value", "max_tokens"),
    "temperature negative": ({"messages": OK_MESSAGES, "temperature": -1}, 422, "invalid_value", "temperature"),
    "n 2": ({"messages": OK_MESSAGES, "n": 2}, 422, "invalid_value", "n"),
    "last message from the system": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "hello"}]},
        400,
        "invalid_messages",
        "messages",
    ),
    "a prefill with no question before it": (
        {"messages": [{"role": "system", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        400,
        "invalid_messages",
        "messages",
    ),
    "blank question": ({"messages": user("   ")}, 400, "invalid_messages", "messages"),
    "bad fusion option": ({"messages": OK_MESSAGES, "segfuse": {"window": 0}}, 400, "invalid_value", None),
    "unknown fusion option": ({"messages": OK_MESSAGES, "segfuse": {"bogus": 1}}, 400, "invalid_value", None),
    "unknown model": ({"messages": OK_MESSAGES, "model": "gpt-9"}, 404, "model_not_found", "model"),
    "invalid JSON schema": (
        {
            "messages": OK_MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
        },
        400,
        "invalid_value",
        "response_format",
    ),
    "json_schema without a schema": (
        {"messages": OK_MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "invalid_value",
        "response_format",
    ),
    "unknown response_format type": (
        {"messages": OK_MESSAGES, "response_format": {"type": "yaml"}},
        400,
        "invalid_value",
        "response_format",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_openai_error_json(http, case):
    body, status, code, param = BAD_REQUESTS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["code"] == code, error
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_oversize_body_gets_413(client, http):
    huge = user("x" * 100_000)
    response = http.post("/v1/chat/completions", json={"messages": huge})
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="segfuse", messages=huge)
    assert caught.value.status_code == 413


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=OK_MESSAGES)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="segfuse", messages=OK_MESSAGES, max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="segfuse", messages=[{"role": "system", "content": "be brief"}])


def test_api_key_is_required(server):
    anonymous = httpx.post(f"{server.api}/chat/completions", json={"messages": OK_MESSAGES}, timeout=30)
    assert anonymous.status_code == 401 and error_of(anonymous)["code"] == "invalid_api_key"
    assert anonymous.headers["www-authenticate"] == "Bearer"
    wrong = OpenAI(base_url=server.api, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # probes need no key


def test_unknown_route_and_method(http):
    missing = http.get("/v1/nothing-here")
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
    wrong_method = http.get("/v1/chat/completions")
    assert wrong_method.status_code == 405 and error_of(wrong_method)["code"] == "method_not_allowed"
    assert http.get("/v1/models/nope").status_code == 404


def test_prompt_too_long_is_a_400_or_an_error_event(client, http):
    """Found only when the worker opens the members' sessions: a status, or an event once streaming."""
    long_prompt = user("word " * 6000)  # about 6000 tokens: more than a member's 4096-token context
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="segfuse", messages=long_prompt, max_tokens=4)
    body = {"messages": long_prompt, "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200  # the stream had begun before the members saw the prompt
        frames = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "invalid_request" and "context" in error["message"]


def test_stop_strings_reach_the_engine(client):
    # Every candidate is cut at its first space, so the answer is one word and ends there.
    answer = ask(client, stop=[" "])
    text = answer.choices[0].message.content
    assert text.strip() and " " not in text
    assert answer.choices[0].finish_reason == "stop"


def test_still_serving_after_bad_input(client, server):
    answer = client.chat.completions.create(model="segfuse", messages=user("Say hello."), max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert server.health()["status"] == "ok"


# --------------------------------------------------------------------------- concurrency


def health_when(server, condition, what: str, timeout: float = 120) -> dict:
    """Poll /health until `condition(health)` holds; return that health."""

    seen = []

    def check():
        seen[:] = [server.health()]
        return seen[0] if condition(seen[0]) else None

    try:
        return wait_for(check, timeout=timeout, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last /health: {seen}") from None


def _stream_until_first_segment(http, stack: ExitStack, prompt: str, max_tokens: int):
    """Open a stream and read it up to its first segment; returns the line iterator, which the
    caller must keep: a dropped iterator closes the connection (httpx), i.e. hangs up."""
    # ignore_eos: the generation runs to max_tokens, so it keeps the worker busy however fast the machine
    response = stack.enter_context(
        http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": user(prompt),
                "max_tokens": max_tokens,
                "stream": True,
                "temperature": 0,
                "segfuse": {"ignore_eos": True, "gate": None},
            },
        )
    )  # every round votes: slow enough to hold the worker
    assert response.status_code == 200
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: {") and '"content": "' in line and '"segment"' in line:
            return lines
    raise AssertionError("the stream ended before its first segment")


def test_disconnect_cancels_the_generation(http, server):
    before = server.health()["counters"]
    with ExitStack() as stack:
        _stream_until_first_segment(http, stack, LONG, max_tokens=400)
        rounds_at_hangup = server.health()["counters"]["rounds"]
        hung_up = time.monotonic()
    # The client has hung up mid-answer: the worker must stop at the end of the round.
    after = health_when(
        server,
        lambda h: h["counters"]["cancelled"] > before["cancelled"] and not h["queue"]["running"],
        "the cancel counter",
    )
    stopped_after = time.monotonic() - hung_up
    c = after["counters"]
    assert c["cancelled"] == before["cancelled"] + 1
    assert c["completed"] == before["completed"]
    assert c["rounds"] - rounds_at_hangup <= 1, "the generation ran on after the client left"
    print(f"generation stopped {stopped_after:.1f} s after the client hung up")


def test_disconnect_cancels_a_non_streaming_request(server):
    before = server.health()["counters"]
    # Every round votes and the answer runs to max_tokens: the request outlives the hang-up however fast the machine.
    body = json.dumps(
        {"messages": user(LONG), "max_tokens": 400, "segfuse": {"ignore_eos": True, "gate": None}}
    ).encode()
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + server.api_key.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        health_when(server, lambda h: h["counters"]["rounds"] > before["rounds"], "the first round")
    after = health_when(
        server,
        lambda h: h["counters"]["cancelled"] > before["cancelled"] and not h["queue"]["running"],
        "the cancel counter",
    )
    assert after["counters"]["completed"] == before["completed"]
    assert after["counters"]["rounds"] - before["rounds"] <= 3


def test_full_queue_answers_429(http, client, server):
    before = server.health()["counters"]
    with ExitStack() as running:
        held = [_stream_until_first_segment(http, running, LONG, max_tokens=400) for _ in range(2)]  # both slots
        with ExitStack() as queued:
            for i in range(8):  # fills every waiting slot
                response = queued.enter_context(
                    http.stream(
                        "POST",
                        "/v1/chat/completions",
                        json={"messages": user(f"Say {i}."), "max_tokens": 4, "stream": True},
                    )
                )
                assert response.status_code == 200
            health_when(server, lambda h: h["queue"]["waiting"] == 8, "8 waiting requests", timeout=30)
            full = http.post("/v1/chat/completions", json={"messages": OK_MESSAGES, "max_tokens": 4})
            assert full.status_code == 429
            error = error_of(full)
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model="segfuse", messages=OK_MESSAGES, max_tokens=4)
        # Their clients left while they waited: the slots free up at once.
        health_when(server, lambda h: h["queue"]["waiting"] == 0, "the queue to empty", timeout=30)
        assert server.health()["queue"]["running"] == len(held)
    after = health_when(server, lambda h: not h["queue"]["running"], "the worker to stop")
    c = after["counters"]
    assert c["rejected"] == before["rejected"] + 2
    assert c["cancelled"] == before["cancelled"] + 10
    assert c["started"] == before["started"] + 2  # the queued ones never ran


def test_load_8_clients_5_requests_each(client, server):
    before = server.health()["counters"]

    def one_client(k: int) -> list[str]:
        answers = []
        for i in range(5):
            messages = user(f"Reply with the number {k * 5 + i}.")
            if i % 2:
                stream = client.chat.completions.create(model="segfuse", messages=messages, max_tokens=4, stream=True)
                chunks = list(stream)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                assert finish and finish[0] in ("stop", "length")
                answers.append(chunks[0].id)
            else:
                answer = client.chat.completions.create(model="segfuse", messages=messages, max_tokens=4)
                assert answer.choices[0].finish_reason in ("stop", "length")
                answers.append(answer.id)
        return answers

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        ids = [i for batch in pool.map(one_client, range(8)) for i in batch]
    elapsed = time.monotonic() - started
    assert len(ids) == len(set(ids)) == 40
    c = server.health()["counters"]
    assert c["completed"] == before["completed"] + 40
    assert c["rejected"] == before["rejected"] and c["failed"] == before["failed"] == 0
    print(f"40 requests from 8 clients in {elapsed:.1f} s")


# --------------------------------------------------------------------------- structured output


def test_response_format_json_schema(client):
    import jsonschema

    messages = user("Extract the person as JSON: Maria Lopez, 34, lives in Seville.")
    answer = client.chat.completions.create(
        model="segfuse", messages=messages, max_tokens=64, temperature=0, response_format=PERSON_FORMAT
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    streamed = client.chat.completions.create(
        model="segfuse", messages=messages, max_tokens=64, temperature=0, response_format=PERSON_FORMAT, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == answer.choices[0].message.content
    anything = client.chat.completions.create(
        model="segfuse",
        messages=user("Describe a cat as JSON."),
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_the_openai_clients_own_structured_parse(client):
    """`client.chat.completions.parse(response_format=<pydantic model>)`: the SDK builds the strict schema
    and parses the answer into the model."""
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    parsed = client.chat.completions.parse(
        model="segfuse",
        messages=user("Extract the person: Tom Baker, aged 51, lives in Leeds."),
        max_tokens=64,
        temperature=0,
        response_format=Person,
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.name and person.age > 0


# --------------------------------------------------------------------------- tool calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_tool_round_trip(client):
    """Call (arguments that validate), the tool's result sent back, then a final answer in text."""
    import jsonschema

    messages = user("What is the weather in Paris right now?")
    first = client.chat.completions.create(
        model="segfuse", messages=messages, max_tokens=64, temperature=0, tools=[WEATHER, CLOCK], tool_choice="required"
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    history = [
        *messages,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    final = client.chat.completions.create(
        model="segfuse", messages=history, max_tokens=48, temperature=0, tools=[WEATHER, CLOCK], tool_choice="none"
    )
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content


def test_a_named_tool_call_streams_as_openai_streams_it(client):
    chunks = list(
        client.chat.completions.create(
            model="segfuse",
            messages=user("Weather in Oslo, in fahrenheit?"),
            max_tokens=64,
            temperature=0,
            tools=[WEATHER, CLOCK],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
        )
    )
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].index == 0 and calls[0][0].function.name == "get_weather"
    assert "city" in json.loads(calls[0][0].function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # no JSON leaks out as text


def test_auto_tool_choice_answers_text_or_a_call(client):
    answer = client.chat.completions.create(
        model="segfuse", messages=user("Say hello to Ada."), max_tokens=24, temperature=0, tools=[WEATHER]
    )
    choice = answer.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls[0].function.name == "get_weather"
    else:
        assert choice.message.content and not choice.message.content.lstrip().startswith("{")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_tools_get_a_400_naming_the_field(http, extra, param):
    body = {"messages": user("hi"), "max_tokens": 4, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


# --------------------------------------------------------------------------- text completions, logprobs


def test_a_text_completion_continues_the_raw_prompt(client):
    answer = client.completions.create(model="segfuse", prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=0)
    choice = answer.choices[0]
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
    # no chat template: the members continue the sequence instead of answering a question about it
    assert choice.text.startswith(" 6,"), choice.text
    assert choice.finish_reason in ("stop", "length") and answer.usage.completion_tokens > 0
    assert 0 < answer.usage.prompt_tokens < 16  # the text alone, no template around it
    echoed = client.completions.create(model="segfuse", prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == "1, 2, 3, 4, 5," + choice.text


def test_text_completion_logprobs_are_the_answer_tokens(client):
    answer = client.completions.create(
        model="segfuse", prompt="The capital of France is", max_tokens=10, temperature=0, logprobs=3
    )
    choice = answer.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert abs(max(top.values()) - logprob) < 1e-4, (token, top)  # greedy: each token was the likeliest


def test_a_streamed_text_completion_matches_the_whole_one(client):
    whole = client.completions.create(model="segfuse", prompt="Once upon a time", max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model="segfuse",
            prompt="Once upon a time",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_list_of_prompts_gets_a_choice_each(client):
    prompts = ["Roses are red,", "def add(a, b):"]
    answer = client.completions.create(model="segfuse", prompt=prompts, max_tokens=6, temperature=0, echo=True)
    assert [c.index for c in answer.choices] == [0, 1]
    for prompt, choice in zip(prompts, answer.choices):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)


def test_chat_logprobs_cover_the_answer_exactly(client):
    members = set(MEMBERS)
    answer = ask(client, logprobs=True, top_logprobs=2, extra_body={"segfuse": {"gate": None, "accept_margin": None}})
    content = answer.choices[0].logprobs.content
    assert "".join(t.token for t in content) == answer.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and bytes(t.bytes).decode() == t.token for t in content)
    authors = {(t.model_extra or {}).get("model") for t in content}
    assert authors <= members and authors == {s["model"] for s in ext(answer)["segments"]}
    streamed = list(ask(client, logprobs=True, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert "".join(tokens) == text and tokens


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "stream"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, 422, "logprobs"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"], "stream": True}, 400, "prompt"),
        ("/v1/completions", {"prompt": "word " * 5000}, 400, None),
        ("/v1/chat/completions", {"messages": user("x"), "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"messages": user("x"), "logprobs": True, "top_logprobs": 21}, 422, "top_logprobs"),
    ],
)
def test_bad_completions_and_logprobs_get_a_clear_error(http, path, body, status, param):
    response = http.post(path, json={"max_tokens": 4, **body})
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["param"] == param
    if param is None:  # the prompt is over every window: the message names a member and its window
        assert "context holds" in error["message"] and any(m in error["message"] for m in MEMBERS)
    assert http.get("/health").json()["status"] == "ok"
