"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/ps, /api/show), driven by the real `ollama` client
against a live server with the embedded members, and one more model loaded on demand (`tiny`): answers
streamed and whole, JSON-schema output, a tool call and its result, preloading and unloading with empty
requests, and errors in Ollama's shape."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import httpx
import jsonschema
import pytest

from helpers import wait_for
from live_app import KEY, LEADER, serve_app
from segfuse import models as catalogue
from segfuse.config import ServerConfig

ollama = pytest.importorskip("ollama")

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

HI = [{"role": "user", "content": "Say hi."}]
TINY = "tiny"  # smollm2 once more, as a member of its own, loaded when a request names it
PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
}


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
      city: the city's name
    """
    return f"Sunny in {city}"


@pytest.fixture(scope="module")
def server(uncached_ensemble):
    """The embedded three as `segfuse` (the session's, kept loaded), and `tiny`, loaded on demand."""
    config = ServerConfig.model_validate(
        {
            "server": {"api_key": KEY, "port": 0, "queue_size": 4, "max_concurrent": 2, "log_level": "warning"},
            "limits": {"max_tokens": 64},
            "members": {"n_ctx": 1024},
            "defaults": {"max_tokens": 8, "temperature": 0},
            "ensembles": {
                "segfuse": {"members": list(catalogue.DEFAULT_MODELS)},
                TINY: {"members": [f"{LEADER}#{TINY}"]},
            },
        }
    )
    with serve_app(config, uncached_ensemble) as (url, state):
        yield url
        assert state.worker.queue.snapshot()["failed"] == 0


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)


def post(server: str, path: str, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server}{path}", json=body, headers=headers, timeout=300)


def running(client) -> dict:
    return {m.model: m for m in client.ps().models}


def test_clients_find_the_server_without_breaking_the_web_view(server):
    assert httpx.get(f"{server}/api/version").json()["version"]  # open, as Ollama's clients probe it
    assert httpx.head(server).status_code == 200  # the ollama command line's heartbeat
    page = httpx.get(server)
    assert page.status_code == 200 and "<html" in page.text.lower()


def test_list_names_every_ensemble_and_member(client):
    models = {m.model: m for m in client.list().models}
    assert {"segfuse", TINY, LEADER} <= set(models)
    fused = models["segfuse"]
    assert fused.details.family == "segfuse" and list(fused.details.families) == list(catalogue.DEFAULT_MODELS)
    assert fused.size > 100_000_000 and len(fused.digest) == 64 and fused.modified_at.year >= 2025
    assert fused.details.format == "gguf" and fused.details.parameter_size.endswith(("M", "B"))


def test_show_tells_the_window_the_defaults_and_a_members_template(client):
    fused = client.show("segfuse")
    assert fused.modelinfo["general.architecture"] == "segfuse"
    assert fused.modelinfo["segfuse.context_length"] > 0 and fused.modelinfo["general.parameter_count"] > 0
    assert "num_predict 8" in fused.parameters and "temperature 0" in fused.parameters
    assert "tools" in fused.capabilities
    assert client.show(f"{LEADER}:latest").template  # a member's own chat template, read from its file


def test_chat_whole_and_streamed_give_the_same_answer(client):
    whole = client.chat(model="segfuse", messages=HI, options={"num_predict": 8})
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.message.content.strip() and 0 < whole.eval_count <= 8 and whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.eval_duration > 0 and whole.load_duration >= 0
    chunks = list(client.chat(model="segfuse", messages=HI, options={"num_predict": 8}, stream=True))
    *pieces, last = chunks
    assert pieces and all(not c.done for c in pieces) and last.done and last.message.content == ""
    assert "".join(c.message.content for c in pieces) == whole.message.content
    assert last.done_reason == whole.done_reason and last.eval_count == whole.eval_count


def test_each_line_says_who_wrote_its_segment(server):
    body = {"model": "segfuse", "messages": HI, "options": {"num_predict": 8}}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server}/api/chat", json=body, headers=headers, timeout=300) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(text) for text in response.iter_lines()]
    *pieces, last = lines
    authors = [p["segfuse"]["segment"]["model"] for p in pieces]
    assert authors and set(authors) <= set(catalogue.DEFAULT_MODELS)
    assert [p["message"]["content"] for p in pieces] == [p["segfuse"]["segment"]["text"] for p in pieces]
    assert last["done"] and last["segfuse"]["stats"]["tokens"] == last["eval_count"]
    assert last["created_at"].endswith("Z") and last["model"] == "segfuse"


def test_generate_templated_raw_and_streamed(client):
    whole = client.generate(model=LEADER, prompt="Name a colour.", system="Be brief.", options={"num_predict": 6})
    assert whole.done and whole.response.strip() and whole.eval_count <= 6
    streamed = list(
        client.generate(
            model=LEADER, prompt="Name a colour.", system="Be brief.", options={"num_predict": 6}, stream=True
        )
    )
    assert "".join(c.response for c in streamed) == whole.response and streamed[-1].done
    raw = client.generate(model=LEADER, prompt="The capital of France is", raw=True, options={"num_predict": 4})
    assert raw.done_reason in ("stop", "length") and raw.response.strip()


def test_a_json_schema_format_gives_json_that_validates(client):
    answer = client.chat(
        model=LEADER,
        messages=[{"role": "user", "content": "Extract the person: Maria Lopez, 34."}],
        format=PERSON,
        options={"num_predict": 48},
    )
    assert answer.done_reason == "stop", answer
    jsonschema.validate(json.loads(answer.message.content), PERSON)
    prompt = 'Reply with this JSON object: {"ok": true}'
    any_json = client.generate(model=LEADER, prompt=prompt, format="json", options={"num_predict": 24})
    assert any_json.done_reason == "stop", any_json
    assert isinstance(json.loads(any_json.response), dict)


def test_a_tool_call_and_its_result(client):
    ask = [{"role": "user", "content": "What is the weather in Paris? Call the tool."}]
    first = client.chat(model="segfuse", messages=ask, tools=[get_weather], options={"num_predict": 48})
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    assert first.done_reason == "stop" and first.message.content == ""
    streamed = list(
        client.chat(model="segfuse", messages=ask, tools=[get_weather], options={"num_predict": 48}, stream=True)
    )
    assert [c.message.tool_calls for c in streamed if c.message.tool_calls] == [first.message.tool_calls]
    result = {"role": "tool", "tool_name": "get_weather", "content": get_weather(**call.function.arguments)}
    second = client.chat(
        model="segfuse", messages=[*ask, first.message, result], tools=[get_weather], options={"num_predict": 12}
    )
    assert second.done and (second.message.content or second.message.tool_calls)


def test_empty_requests_load_and_unload_a_model(client):
    assert TINY not in running(client)
    loaded = client.generate(model=TINY, keep_alive="10m")
    assert loaded.done and loaded.done_reason == "load" and not loaded.response
    model = running(client)[TINY]
    assert model.size > 50_000_000 and model.size_vram == 0 and model.context_length > 0
    until = model.expires_at - datetime.now(UTC)
    assert timedelta(minutes=9) < until <= timedelta(minutes=10), model.expires_at
    assert running(client)["segfuse"].expires_at.year > 2300  # kept: Ollama's keep_alive -1
    unloaded = client.chat(model=TINY, messages=[], keep_alive=0)
    assert unloaded.done and unloaded.done_reason == "unload" and unloaded.message.role == "assistant"
    wait_for(lambda: TINY not in running(client), 30, what="tiny to be freed")


def test_errors_are_in_ollamas_shape(server, client):
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="no-such-model", messages=HI)
    assert unknown.value.status_code == 404 and "segfuse" in unknown.value.error
    bad = httpx.post(
        f"{server}/api/chat",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    image = {"role": "user", "content": "What is this?", "images": ["aGk="]}
    refused = post(server, "/api/chat", {"model": LEADER, "messages": [image]})
    assert refused.status_code == 400 and "images" in refused.json()["error"]
    assert post(server, "/api/chat", {"model": LEADER, "messages": HI}, key=None).status_code == 401
    wrong = httpx.get(f"{server}/api/tags", headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401 and set(wrong.json()) == {"error"}
    schema = post(server, "/api/chat", {"model": LEADER, "messages": HI, "format": {"type": "bogus"}})
    assert schema.status_code == 400 and schema.json()["error"].startswith("format")
    embed = post(server, "/api/embed", {"model": LEADER, "input": "hi"})
    assert embed.status_code == 501 and "embeddings" in embed.json()["error"]
    assert post(server, "/api/generate", {"model": LEADER, "prompt": "hi", "context": [1, 2]}).status_code == 400
