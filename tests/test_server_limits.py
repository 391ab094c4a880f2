"""Hostile and careless clients against a live server: limits, parsing off the loop, privacy, browsers, clean errors.

Each server here is the real app (``create_app``) with the real embedded members (loaded once per
session, conftest.py), served by uvicorn with the settings `segfuse serve` uses
(``uvicorn_settings``) on a free loopback port. Most requests are refused before any member runs;
the few that generate ask for a handful of tokens. After each test the server still answers a
normal request (``assert_healthy``).
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from helpers import wait_for
from live_app import serve_app
from segfuse.config import LimitsSection, ServerConfig
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.server.answer import Answer
from segfuse.server.app import ServerState, create_app
from segfuse.server.connections import PendingConnections
from segfuse.server.worker.jobs import Job
from segfuse.types import Departure, Result, Stats

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

KEY = "limits-key"
SAY_HI = [{"role": "user", "content": "Say hi."}]
LEADER = "smollm2-135m"  # the quickest member, alone, for the requests that generate
LIMITS = {
    "max_tokens": 64,
    "max_stops": 4,
    "max_stop_chars": 32,
    "max_prompts": 4,
    "max_messages": 40,
    "max_content_chars": 20_000,
    "max_tools": 4,
    "max_tools_bytes": 8192,
    "max_schema_bytes": 4096,
    "max_schema_depth": 16,
    "header_timeout_s": 2.0,
    "body_timeout_s": 2.0,
    "limit_concurrency": 8,
    "max_header_bytes": 8192,
}


@dataclass
class Live:
    url: str
    state: ServerState

    def post(self, path: str, body: Any, key: bool = True, **headers: str) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **headers}
        if key:
            sent["Authorization"] = f"Bearer {KEY}"
        return httpx.post(f"{self.url}{path}", content=content, headers=sent, timeout=300)

    def get(self, path: str, key: bool = False) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}"} if key else {}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=60)

    @property
    def address(self) -> tuple[str, int]:
        host, _, port = self.url.removeprefix("http://").rpartition(":")
        return host, int(port)


@contextmanager
def live(ensemble, *, api_key: str | None = KEY, limits: dict[str, Any] | None = None, **server: Any) -> Iterator[Live]:
    """The app over `ensemble`, served by uvicorn in a thread as `segfuse serve` serves it."""
    config = ServerConfig.model_validate(
        {
            "server": {
                "api_key": api_key,
                "port": 0,
                "queue_size": 4,
                "max_concurrent": 1,
                "log_level": "warning",
                "max_body_bytes": 2_000_000,
                **server,
            },
            "limits": {**LIMITS, **(limits or {})},
            "defaults": {"max_tokens": 8, "temperature": 0},
        }
    )
    with serve_app(config, ensemble) as (url, state):
        yield Live(url, state)


@pytest.fixture(scope="module")
def server(default_ensemble) -> Iterator[Live]:
    with live(default_ensemble) as running:
        yield running
        counters = running.state.worker.queue.snapshot()
        assert counters["failed"] == 0, counters


def assert_healthy(server: Live) -> None:
    """A normal request still gets a correct answer, and nothing is left held."""
    response = server.post("/v1/chat/completions", {"model": LEADER, "messages": SAY_HI, "max_tokens": 2})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["message"]["content"].strip() and answer["usage"]["completion_tokens"] >= 1
    worker = server.state.worker

    def idle() -> bool:
        return worker.queue.state() == (0, 0) and all(
            o.free_slots in (None, o.slots) for o in worker.queue.occupancy().values()
        )

    wait_for(idle, 60, what=f"no request or slot held (now {worker.queue.state()}, {worker.queue.occupancy()})")


def error_of(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": SAY_HI, "max_tokens": 2, **fields}


def schema_format(schema: dict[str, Any], name: str = "x") -> dict[str, Any]:
    """A chat's `response_format` that holds the answer to `schema`."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def answer_to_schema(server: Live, name: str, schema: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The leader's chat answer held to `schema`: the body of a 200."""
    response = server.post(
        "/v1/chat/completions", chat(model=LEADER, max_tokens=max_tokens, response_format=schema_format(schema, name))
    )
    assert response.status_code == 200, response.text
    return response.json()


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


# --------------------------------------------------------------------------- limits, each named in its refusal


LIMIT_CASES = {
    "max_tokens": (chat(max_tokens=100_000), "max_tokens", "max_tokens"),
    "max_completion_tokens": (chat(max_completion_tokens=65), "max_completion_tokens", "max_tokens"),
    "segfuse.max_tokens": (chat(segfuse={"max_tokens": 10_000}), "segfuse.max_tokens", "max_tokens"),
    "stop count": (chat(stop=["a", "b", "c", "d", "e"]), "stop", "max_stops"),
    "stop length": (chat(stop="x" * 33), "stop", "max_stop_chars"),
    # segfuse.stop used to skip the top-level limit: 150,000 stops cost 28 ms per candidate per round
    "segfuse.stop count": (chat(segfuse={"stop": ["x"] * 150_000}), "segfuse.stop", "max_stops"),
    "segfuse.stop length": (chat(segfuse={"stop": ["y" * 40]}), "segfuse.stop", "max_stop_chars"),
    "messages": (chat(messages=SAY_HI * 41), "messages", "max_messages"),
    "content": (chat(messages=[{"role": "user", "content": "z" * 20_001}]), "messages", "max_content_chars"),
    "tools count": (chat(tools=[tool(f"t{i}") for i in range(5)]), "tools", "max_tools"),
    "tools size": (chat(tools=[tool("t", {"type": "object", "description": "d" * 8200})]), "tools", "max_tools_bytes"),
    "tool schema size": (
        chat(tools=[tool("t", {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}})]),
        "tools[0].function.parameters",
        "max_schema_bytes",
    ),
    "tool schema depth": (
        chat(tools=[tool("t", nested_schema(9))]),
        "tools[0].function.parameters",
        "max_schema_depth",
    ),
    "schema size": (
        chat(
            response_format=schema_format(
                {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
            )
        ),
        "response_format",
        "max_schema_bytes",
    ),
    "schema depth": (
        chat(response_format=schema_format(nested_schema(9))),
        "response_format",
        "max_schema_depth",
    ),
    # ~100 levels used to answer 500 (the schema checker's recursion)
    "schema nested 100 levels": (
        chat(response_format=schema_format(nested_schema(100))),
        "response_format",
        "max_json_depth",
    ),
}


@pytest.mark.parametrize("case", list(LIMIT_CASES))
def test_each_limit_is_refused_naming_the_field_and_the_limit(server, case):
    body, param, setting = LIMIT_CASES[case]
    accepted = server.state.worker.queue.snapshot()["accepted"]
    error = error_of(server.post("/v1/chat/completions", body), 400, "limit_exceeded", param)
    assert f"[limits] {setting}" in error["message"], error
    assert server.state.worker.queue.snapshot()["accepted"] == accepted  # refused before the queue


def test_text_completion_limits_and_prompts_take_queue_places(server):
    body = {"model": LEADER, "prompt": ["Once"] * 5, "max_tokens": 2}
    error = error_of(server.post("/v1/completions", body), 400, "limit_exceeded", "prompt")
    assert "[limits] max_prompts" in error["message"]
    error_of(
        server.post("/v1/completions", {**body, "prompt": "Once", "segfuse": {"stop": ["s"] * 5}}),
        400,
        "limit_exceeded",
        "segfuse.stop",
    )
    # queue_size 4 and one slot: five places when idle. Four prompts fit; with two requests waiting they do
    # not, and the request is refused whole, before any prompt takes a place.
    answer = server.post("/v1/completions", {**body, "prompt": ["Once", "Twice", "Thrice", "Then"]})
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 4, answer.text
    with ExitStack() as stack:
        held = [
            stack.enter_context(
                httpx.stream(
                    "POST",
                    f"{server.url}/v1/chat/completions",
                    timeout=300,
                    headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                    json={
                        "model": LEADER,
                        "messages": [{"role": "user", "content": "Count to 500."}],
                        "max_tokens": 64,
                        "stream": True,
                    },
                )
            )
            for _ in range(4)
        ]
        # one running, three waiting: at most one free place (two, should one answer end meanwhile)
        wait_for(lambda: sum(server.state.worker.queue.state()) == 4, 60, what="four requests in")
        accepted = server.state.worker.queue.snapshot()["accepted"]
        error = error_of(
            server.post("/v1/completions", {**body, "prompt": ["a", "b", "c", "d"]}), 429, "queue_full", "prompt"
        )
        assert "4 prompts need 4 places" in error["message"], error
        assert server.state.worker.queue.snapshot()["accepted"] == accepted  # no prompt took a place
        for response in held:
            response.close()
    wait_for(lambda: server.state.worker.queue.state() == (0, 0), 120, what="the held requests to end")
    assert_healthy(server)


# --------------------------------------------------------------------------- heavy input, parsed off the loop


def test_twenty_thousand_tool_results_are_refused_and_merged_linearly(server, default_ensemble):
    results = [{"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}"} for i in range(20_000)]
    body = chat(
        messages=[
            *SAY_HI,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            *results,
            *SAY_HI,
        ]
    )
    error_of(server.post("/v1/chat/completions", body), 400, "limit_exceeded", "messages")
    # Within a raised limit they are one user turn, in order (joined once, not by repeated concatenation).
    from segfuse.config import LimitsSection
    from segfuse.server.chat import planning

    plan = planning.plan_chat(
        json.dumps(body).encode(),
        server.state.defaults,
        LimitsSection(max_messages=30_000, max_content_chars=1_000_000),
    )
    merged = [m for m in plan.fusion.messages if m.role == "user" and m.content.startswith("Result of f (c0)")]
    assert len(merged) == 1 and merged[0].content.count("Result of ") == 20_000
    assert merged[0].content.index("Result of c19999:") > merged[0].content.index("Result of c9999:")


def test_requests_are_parsed_off_the_event_loop(server, monkeypatch):
    """Parsing, limits, tools and schema compilation run in a worker thread, not on uvicorn's loop."""
    from segfuse.server import parsing
    from segfuse.server.chat import planning

    seen: list[str] = []

    def spy(original):
        def run(*args, **kwargs):
            seen.append(threading.current_thread().name)
            return original(*args, **kwargs)

        return run

    monkeypatch.setattr(planning, "plan_chat", spy(planning.plan_chat))
    monkeypatch.setattr(parsing, "parse_request", spy(parsing.parse_request))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    answer_to_schema(server, "n", schema, max_tokens=8)
    assert server.post("/v1/completions", {"model": LEADER, "prompt": "Once", "max_tokens": 1}).status_code == 200
    assert len(seen) >= 2 and "test-uvicorn" not in seen, seen  # the loop runs on the uvicorn thread


def test_a_catastrophic_pattern_does_not_freeze_the_server(server):
    """patternProperties "^(a+)+$" against 40 a's and a '!': Python's re would backtrack for hours holding the
    GIL; the finished answer is checked by llguidance instead, which enforced the schema."""
    key = "a" * 40 + "!"
    schema = {
        "type": "object",
        "properties": {key: {"const": 1}},
        "required": [key],
        "patternProperties": {"^(a+)+$": {}},
        "additionalProperties": False,
    }
    choice = answer_to_schema(server, "evil", schema, max_tokens=48)["choices"][0]
    assert choice["finish_reason"] == "stop" and json.loads(choice["message"]["content"]) == {key: 1}
    assert server.get("/health").status_code == 200
    assert_healthy(server)


# --------------------------------------------------------------------------- clean errors


MALFORMED = {
    "function a string": ({"id": "c1", "type": "function", "function": "x"}, "messages.0.tool_calls.0.function"),
    "id a list": (
        {"id": ["c1"], "type": "function", "function": {"name": "f", "arguments": "{}"}},
        "messages.0.tool_calls.0.id",
    ),
    "arguments a dict": (
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}},
        "messages.0.tool_calls.0.function.arguments",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_tool_calls_are_4xx_naming_the_field(server, case):
    call, param = MALFORMED[case]
    body = chat(messages=[{"role": "assistant", "content": None, "tool_calls": [call]}, *SAY_HI])
    error_of(server.post("/v1/chat/completions", body), 422, "invalid_value", param)


def test_a_body_nested_thousands_deep_is_a_400(server):
    error_of(server.post("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000), 400, "limit_exceeded", "body")
    error_of(
        server.post("/v1/chat/completions", chat(segfuse={"x": json.loads("[" * 80 + "]" * 80)})),
        400,
        "limit_exceeded",
        "segfuse",
    )


def test_a_lone_surrogate_is_a_400_naming_its_field(server):
    # JSON may spell half of a UTF-16 pair; no tokenizer can encode it (it was a 500 from the worker).
    error_of(
        server.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
        400,
        "invalid_value",
        "messages.0.content",
    )
    error_of(server.post("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}'), 400, "invalid_value", "prompt")


@pytest.mark.parametrize(
    "options, param",
    [
        ({"seed": 2**64}, "seed"),
        ({"segfuse": {"hedge_eta": 1e308}}, "segfuse.hedge_eta"),
        ({"segfuse": {"hedge": True, "hedge_persist": True}}, "segfuse.hedge_persist"),
    ],
)
def test_refused_fusion_options_name_their_field(server, options, param):
    response = server.post("/v1/chat/completions", chat(model=LEADER, **options))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_cache_salt_is_a_bounded_request_field(server):
    error_of(server.post("/v1/chat/completions", chat(cache_salt="s" * 257)), 422, "invalid_value", "cache_salt")
    response = server.post("/v1/chat/completions", chat(model=LEADER, cache_salt="tenant-a"))
    assert response.status_code == 200, response.text


def test_client_strings_are_logged_quoted(server, caplog):
    with caplog.at_level(logging.INFO, logger="segfuse.server"):
        response = server.post(
            "/v1/chat/completions",
            chat(model=LEADER, max_tokens=1, user="bob\n2026-01-01 INFO forged line" + "x" * 500),
        )
    assert response.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if "for user" in r.getMessage()]
    assert lines and all("\n" not in line and len(line) < 200 for line in lines), lines
    assert "'bob\\n2026-01-01 INFO forged line" in lines[-1]


def test_internal_texts_lose_paths_and_urls_without_the_key():
    departure = Departure(
        "m", 2, "fault", "ConnectionError: http://10.0.0.5:8080/v1 refused; model /srv/models/secret-name.gguf"
    )
    result = Result(text="", segments=[], rounds=[], stats=Stats(), models=["m"], departures=[departure])
    job = Job(FusionRequest.of("hi", FusionOptions()))
    shown = Answer(job, "m").info(result).departures[0]["reason"]
    assert "10.0.0.5" not in shown and "/srv/models" not in shown and "<url>" in shown and "<path>" in shown
    assert Answer(job, "m", detailed=True).info(result).departures[0]["reason"] == departure.reason


def test_a_load_error_shows_its_path_only_to_the_key():
    """Members that fail to load: /health and the 503 say so; paths only with the key."""
    missing = "/nonexistent/models/secret-model.gguf"
    config = ServerConfig.model_validate({"server": {"api_key": KEY}, "members": {"models": [missing]}})
    from fastapi.testclient import TestClient

    with TestClient(create_app(config), base_url="http://127.0.0.1") as client:
        key = {"Authorization": f"Bearer {KEY}"}
        health = wait_for(
            lambda: (h := client.get("/health", headers=key).json())["status"] == "failed" and h,
            120,
            what="the load to fail",
        )
        assert "secret-model" in health["error"]
        assert client.get("/health").json() == {"status": "failed"}  # no key: the status only
        refused = client.post("/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {KEY}"})
        assert refused.status_code == 503 and "secret-model" in refused.json()["error"]["message"]
    keyless = ServerConfig.model_validate({"members": {"models": [missing]}})
    with TestClient(create_app(keyless), base_url="http://127.0.0.1") as client:
        health = wait_for(
            lambda: (h := client.get("/health").json())["status"] == "failed" and h, 120, what="the load to fail"
        )
        assert "/nonexistent" not in health["error"] and "<path>" in health["error"]
        refused = client.post("/v1/chat/completions", json=chat()).json()["error"]["message"]
        assert "/nonexistent" not in refused


# --------------------------------------------------------------------------- privacy


def test_health_metrics_and_openapi_without_the_key(server):
    server.post("/v1/chat/completions", chat(model=LEADER, max_tokens=1))  # something in the prefix caches
    assert server.get("/health").json() == {"status": "ok"}
    full = server.get("/health", key=True).json()
    assert full["counters"]["completed"] >= 1 and full["occupancy"][LEADER]["prefix"]["hits"] >= 0
    open_metrics, key_metrics = server.get("/metrics").text, server.get("/metrics", key=True).text
    assert "segfuse_requests_total" in open_metrics and "segfuse_queue_depth" in open_metrics
    assert "segfuse_member_" not in open_metrics and LEADER not in open_metrics  # no member, not even its name
    assert "segfuse_member_prefix_cache_reused_tokens_total" in key_metrics
    assert server.get("/openapi.json").status_code == 401
    assert server.get("/openapi.json", key=True).json()["info"]["title"] == "segfuse"


def test_a_keyless_server_shows_everything(default_ensemble):
    with live(default_ensemble, api_key=None) as keyless:
        assert "counters" in keyless.get("/health").json()
        assert "segfuse_member_prefix_cache_hits_total" in keyless.get("/metrics").text
        assert keyless.get("/openapi.json").status_code == 200


# --------------------------------------------------------------------------- browsers


def test_json_endpoints_need_a_json_content_type(server):
    for path in ("/v1/chat/completions", "/v1/completions"):
        for kind in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
            response = httpx.post(
                f"{server.url}{path}",
                content=json.dumps(chat()),
                timeout=60,
                headers={"Authorization": f"Bearer {KEY}", **kind},
            )
            error_of(response, 415, "unsupported_media_type")
        bare = httpx.post(
            f"{server.url}{path}", content=json.dumps(chat()), timeout=60, headers={"Authorization": f"Bearer {KEY}"}
        )
        error_of(bare, 415, "unsupported_media_type")
    response = server.post(
        "/v1/chat/completions", {"model": "segfuse"}, **{"Content-Type": "application/json; charset=utf-8"}
    )
    error_of(response, 422, "invalid_value", "messages")  # past the media type check


def test_other_host_headers_are_refused(server):
    _, port = server.address
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.2"):
        response = httpx.get(f"{server.url}/health", headers={"Host": host}, timeout=30)
        error_of(response, 400, "invalid_host")
        posted = server.post("/v1/chat/completions", chat(), Host=host)
        error_of(posted, 400, "invalid_host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(f"{server.url}/health", headers={"Host": host}, timeout=30).status_code == 200, host


def test_allowed_hosts_names_a_proxy(default_ensemble):
    with live(default_ensemble, allowed_hosts=["api.example.org"]) as proxied:
        ok = httpx.get(f"{proxied.url}/health", headers={"Host": "api.example.org"}, timeout=30)
        assert ok.status_code == 200
        error_of(httpx.get(f"{proxied.url}/health", timeout=30), 400, "invalid_host")


# --------------------------------------------------------------------------- slow and greedy connections


def _connect(server: Live) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=30)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_client_slow_to_send_its_headers_is_cut_off(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the headers never end
        assert _read_all(sock) == b""  # closed by the server (a socket timeout here fails the test)
    assert server.get("/health").status_code == 200


def test_a_client_slow_to_send_its_body_gets_408(server):
    with _connect(server) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 1000\r\n\r\n{"messages"'
        )
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"body_timeout_s" in reply


def test_oversized_headers_are_refused(server):
    whole = httpx.get(f"{server.url}/health", headers={"X-Big": "h" * 10_000}, timeout=30)
    error_of(whole, 431, "headers_too_large")
    with _connect(server) as sock:  # in pieces: uvicorn's own bound
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"h" * 10_000)
        assert _read_all(sock).startswith(b"HTTP/1.1 400")
    assert server.get("/health").status_code == 200


def _open_request(server: Live) -> socket.socket:
    """A connection whose request is in flight: its headers sent, its body still coming."""
    sock = _connect(server)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 1000\r\n\r\n{"messages"'
    )
    return sock


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(server):
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]  # a handler that keeps the records
    uvicorn_log = logging.getLogger("uvicorn.error")  # where uvicorn logs an exception the app let out
    uvicorn_log.addHandler(handler)
    try:
        for _ in range(3):
            _open_request(server).close()
        assert_healthy(server)  # answered after the hang-ups were read
    finally:
        uvicorn_log.removeHandler(handler)
    assert not errors, [r.getMessage() for r in errors]


def test_requests_in_flight_beyond_limit_concurrency_get_503(default_ensemble):
    limit = LIMITS["limit_concurrency"]
    with live(default_ensemble, limits={"header_timeout_s": 60, "body_timeout_s": 60}) as busy:
        with ExitStack() as stack:
            for _ in range(2 * limit):  # connections without a request do not count
                stack.enter_context(_connect(busy))
            assert busy.get("/health").status_code == 200  # accepted after them: they were all open by then
            for _ in range(limit):
                stack.enter_context(_open_request(busy))
            refused = wait_for(
                lambda: (r := busy.get("/health")).status_code == 503 and r, 30, what=f"{limit} requests in flight"
            )
            error_of(refused, 503, "server_busy")
            assert f"limit_concurrency {limit}" in refused.json()["error"]["message"]
            assert refused.headers["connection"] == "close"
        wait_for(lambda: busy.get("/health").status_code == 200, 30, what="the requests to end")
        assert_healthy(busy)


SLOW_ADDRESS = "127.0.0.5"  # one client's address, apart from the 127.0.0.1 every other request comes from


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (non-blocking; nothing else is ever sent on it)."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


# A request beside the slow sockets is answered within max(2 s, SLOWER x the same request to an idle server):
# the sockets cost the server a little accepting and closing, not a wait. 10x leaves room for a loaded
# machine, where one 2-token request can take several times another; the header deadline is set far beyond
# it, so that a request that waited for the deadline to close the slow sockets fails however slow the machine.
SLOWER = 10


def _idle_time(server: Live, n: int = 3) -> float:
    """The median of `n` plain requests to the idle server (seconds): this machine's baseline, now."""
    times = []
    for _ in range(n):
        began = time.monotonic()
        assert server.post("/v1/chat/completions", chat(model=LEADER)).status_code == 200
        times.append(time.monotonic() - began)
    print(f"the same request to an idle server: {', '.join(f'{t:.2f}' for t in times)} s")
    return statistics.median(times)


def test_slow_sockets_from_one_address_do_not_starve_others(default_ensemble, server, caplog):
    allowed = max(2.0, SLOWER * _idle_time(server))  # the module's server: the same app, idle
    # A header deadline far longer than that: whatever closes the slow sockets, and whatever lets the
    # request through, is not the deadline.
    limits = {"header_timeout_s": max(120.0, 4 * allowed)}
    bound = LimitsSection().max_pending_per_client
    with live(default_ensemble, limits=limits) as crowded:
        with ExitStack() as stack, caplog.at_level(logging.WARNING, logger="segfuse.server"):
            slow = []
            for _ in range(200):
                sock = stack.enter_context(socket.socket())
                sock.bind((SLOW_ADDRESS, 0))
                sock.connect(crowded.address)
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
                sock.setblocking(False)
                slow.append(sock)
            began = time.monotonic()
            response = crowded.post("/v1/chat/completions", chat(model=LEADER))
            took = time.monotonic() - began
            print(f"answered in {took:.2f} s beside 200 slow sockets ({allowed:.2f} s allowed)")
            assert response.status_code == 200, response.text  # at once: before, 503 until the deadline closed them
            assert took <= allowed, f"{took:.2f} s beside 200 slow sockets, {allowed:.2f} s allowed"
            closed = wait_for(
                lambda: (n := sum(map(_closed_by_server, slow))) >= len(slow) - bound and n,
                60,
                what=f"the server to close all but {bound} of the slow sockets",
            )
            assert closed >= len(slow) - bound
            refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused:")]
            assert 1 <= len(refusals) <= 2, refusals  # one line at once, the rest counted into one more
            assert "max_pending_per_client" in refusals[0] and SLOW_ADDRESS in refusals[0], refusals
        assert_healthy(crowded)  # and it serves on once they are gone


def test_pending_connections_close_the_oldest_past_each_bound():
    pending = PendingConnections(per_client=2, total=3)
    assert pending.add("a1", "A") == [] and pending.add("a2", "A") == []
    assert pending.add("a3", "A") == [("a1", "max_pending_per_client")]
    pending.add("a2", "A")  # pending again (after an answer): now A's newest
    assert pending.add("a4", "A") == [("a3", "max_pending_per_client")]
    assert pending.add("b1", "B") == [] and (len(pending), pending.of("A"), pending.of("B")) == (3, 2, 1)
    assert pending.add("c1", "C") == [("a2", "max_pending_connections")]  # the oldest of all
    pending.discard("a4")
    pending.discard("a4")
    assert (len(pending), pending.of("A")) == (2, 0)


# --------------------------------------------------------------------------- the per-request deadline


def test_a_request_past_its_deadline_ends_or_fails_clearly(default_ensemble):
    with live(default_ensemble, limits={"request_timeout_s": 0.001}) as hurried:
        response = hurried.post(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Count from 1 to 300."}], "max_tokens": 64},
        )
        if response.status_code == 200:  # admitted in time: the answer ended at the deadline
            body = response.json()
            assert body["segfuse"]["stats"]["finish_reason"] == "deadline", body["segfuse"]["stats"]
            assert body["choices"][0]["finish_reason"] == "length"
        else:  # still queued when it passed
            error_of(response, 504, "deadline_exceeded")
