"""Loading seen by clients, on an in-process server with room for one member (`max_loaded_members = 1`) and two
models, `small` (smollm2, loaded at start) and `coder` (qwen2.5-coder-0.5b): a request for one model loads it
in place of the other. A stream waiting for its member hears from the server at once (an SSE comment, or
Anthropic's ping), and still parses with the real clients; a request waiting for a load is served after the
requests in flight, not after every request that comes after it (first come, first served between models)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from helpers import wait_for
from live_app import serve_app
from segfuse.config import ServerConfig

pytestmark = [pytest.mark.models, pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "loading-key"
SMALL, CODER = "smollm2-135m", "qwen2.5-coder-0.5b"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = ServerConfig.model_validate(
        {
            "server": {
                "api_key": KEY,
                "port": 0,
                "queue_size": 8,
                "max_concurrent": 2,
                "log_level": "warning",
                "max_loaded_members": 1,
                "preload": ["small"],
                "keep_alive": "-1",
            },
            "limits": {"request_timeout_s": 60},  # a request that starves fails within a minute
            "members": {"threads": 1, "n_ctx": 512},
            "defaults": {"max_tokens": 4, "temperature": 0},
            "ensembles": {
                "small": {"members": [SMALL]},
                "coder": {"members": [CODER]},
                "broken": {"members": ["/nonexistent/models/missing.gguf#lost"]},
            },
        }
    )
    with serve_app(config, None) as (served, state):
        wait_for(lambda: state.status == "ok", 120, what="the small model to load")
        yield served


def memory(url: str) -> dict:
    return httpx.get(f"{url}/health", headers=HEADERS, timeout=30).json()["memory"]


def unloaded(url: str, member: str) -> None:
    """`member` not loaded: asking the other model, with room for one member, frees it."""
    if memory(url)[member]["state"] == "loaded":
        other = {"model": "coder" if member == SMALL else "small", "messages": ASK, "max_tokens": 1}
        assert httpx.post(f"{url}/v1/chat/completions", json=other, headers=HEADERS, timeout=120).status_code == 200
    wait_for(lambda: memory(url)[member]["state"] == "unloaded", 60, what=f"{member} to be freed")


# --------------------------------------------------------------------------- a stream that waits for a load


def test_a_stream_waiting_for_its_member_hears_at_once_and_its_answer_is_whole(url):
    unloaded(url, CODER)
    body = {"model": "coder", "messages": ASK, "max_tokens": 4, "stream": True}
    sent = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=HEADERS, timeout=120) as response:
        assert response.status_code == 200
        raw = response.iter_raw()
        first = next(raw)
        first_byte_s = time.monotonic() - sent
        rest = b"".join(raw)
    print(f"time to first byte while {CODER} loads: {first_byte_s:.3f} s")
    assert first.startswith(f": loading {CODER}\n\n".encode()), first
    assert first_byte_s < 5.0  # 1 s is the target; loose for a busy machine
    frames = (first + rest).decode()
    assert "data: [DONE]" in frames and '"finish_reason":"length"' in frames.replace(" ", ""), frames[-500:]


def test_the_openai_client_reads_a_stream_that_waited_for_a_load(url):
    unloaded(url, SMALL)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    with client.chat.completions.create(model="small", messages=ASK, max_tokens=4, stream=True) as chunks:
        pieces = list(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices).strip()
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    unloaded(url, CODER)
    stream = client.responses.create(model="coder", input="Name a colour.", max_output_tokens=16, stream=True)
    events = [e.type for e in stream]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete"), events


def test_the_anthropic_client_gets_pings_while_its_member_loads(url):
    unloaded(url, SMALL)
    body = {"model": "small", "messages": ASK, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120) as response:
        raw = response.iter_raw()
        first = next(raw).decode()
        rest = b"".join(raw).decode()
    assert (first + rest).startswith(f": loading {SMALL}\n\nevent: ping\n"), (first, rest[:100])
    assert "event: message_start" in rest and rest.endswith('data: {"type": "message_stop"}\n\n'), rest[-300:]
    unloaded(url, CODER)
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)  # skips pings itself
    with client.messages.stream(model="coder", max_tokens=4, messages=ASK) as stream:
        message = stream.get_final_message()
    assert message.model == "coder" and message.content[0].text.strip(), message


def test_a_load_that_fails_ends_the_stream_with_the_apis_error_event(url):
    body = {"model": "broken", "messages": ASK, "max_tokens": 4, "stream": True}
    failed = httpx.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS, timeout=60)
    assert failed.status_code == 200 and failed.text.startswith(": loading lost\n\n"), failed.text
    error = json.loads(failed.text.split("data: ", 1)[1].split("\n\n", 1)[0])["error"]
    assert error["code"] == "model_load_failed" and "lost" in error["message"], error
    assert failed.text.endswith("data: [DONE]\n\n")
    # What can be refused before any member loads still is, with its status.
    bad = httpx.post(f"{url}/v1/chat/completions", json={**body, "keep_alive": "soon"}, headers=HEADERS, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


# --------------------------------------------------------------------------- a load does not starve


def test_a_request_waiting_for_a_load_is_served_before_newer_requests_for_the_loaded_model(url):
    """Four clients keep the loaded model busy; a request for the other model arrives: it waits for the
    answers in flight, not for every answer after it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    client.chat.completions.create(model="small", messages=ASK, max_tokens=1)  # small loaded, coder not
    answers: list[float] = []  # when each of small's answers came
    failures: list[str] = []
    done = threading.Event()

    def busy() -> None:
        while not done.is_set() and len(answers) < 60:
            try:
                client.chat.completions.create(model="small", messages=ASK, max_tokens=4)
                answers.append(time.monotonic())
            except Exception as exc:  # reported by the test
                failures.append(f"{type(exc).__name__}: {exc}")
                return

    clients = [threading.Thread(target=busy) for _ in range(4)]
    for thread in clients:
        thread.start()
    wait_for(lambda: len(answers) >= 4, 60, what="the clients to be busy")
    asked = time.monotonic()
    try:
        answer = client.chat.completions.create(model="coder", messages=ASK, max_tokens=4)
    finally:
        answered = time.monotonic()
        done.set()
        for thread in clients:
            thread.join(120)
    meanwhile = sum(asked < t < answered for t in answers)
    print(f"coder answered after {answered - asked:.1f} s, {meanwhile} of small's answers meanwhile")
    assert answer.model == "coder" and not failures, failures
    assert meanwhile <= 8, f"{meanwhile} answers to small came while coder waited to load"
