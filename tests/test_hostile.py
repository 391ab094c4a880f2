"""The aftermath of hostile requests: a live server answers or refuses each as it must, then still answers
a normal request the same as before, and holds nothing (no queue entry, slot or KV-cache cell).

The hostile requests are the soak's (``bench/soak/traffic.py``'s ``HOSTILE``: a random seed of -1, seeds past
64 bits, spelled role tokens, malformed earlier tool calls, deep and backtracking schemas, Hedge options
that would outlive the request, many stop strings, a deeply nested body, a browser's text/plain request, a
foreign Host header) and go through the soak's own client, so that both judge them alike. Each is sent
more times than the server has slots: a request that leaks one slot would leave none, and the normal
request after it would wait for ever (here: a client time-out, a failure).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from helpers import live_server
from segfuse import models as catalogue
from segfuse.bench.soak.client import SoakClient
from segfuse.bench.soak.traffic import HOSTILE, Action

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

SLOTS = 4  # `segfuse serve`'s default max_concurrent: one slot per generation in flight, per member
TIMEOUT_S = 120.0
NORMAL = {
    "model": "segfuse",
    "messages": [{"role": "user", "content": "Name three primary colors."}],
    "max_tokens": 4,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = [n for n in catalogue.DEFAULT_MODELS if not catalogue.is_ready(catalogue.CATALOGUE[n])]
    if missing:
        pytest.fail(f"models not prepared: {missing}; run `make models`", pytrace=False)
    with live_server(tmp_path_factory.mktemp("hostile"), max_concurrent=SLOTS) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(
        base_url=server.url,
        headers={"Authorization": f"Bearer {server.api_key}"},
        timeout=httpx.Timeout(TIMEOUT_S, connect=10),
    ) as session:
        yield session


@pytest.fixture(scope="module")
def soak_client(server):
    client = SoakClient(
        server.url, server.api_key, n_ctx=4096, max_body_bytes=65536, t0=time.monotonic(), request_timeout_s=TIMEOUT_S
    )
    yield client
    client.close()


def normal(http: httpx.Client) -> str:
    response = http.post("/v1/chat/completions", json=NORMAL)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def baseline(http):
    text = normal(http)
    assert text.strip()
    return text


def held(health: dict) -> list[str]:
    """What the server holds that an idle one must not."""
    found = [f"queue {health['queue']}"] if health["queue"]["waiting"] or health["queue"]["running"] else []
    for name, o in health["occupancy"].items():
        if o["free_slots"] != o["slots"]:
            found.append(f"{name}: {o['slots'] - o['free_slots']} of {o['slots']} slots")
        if o["cache_cells"] or o["stray_cells"]:
            found.append(f"{name}: {o['cache_cells']} session cells, {o['stray_cells']} stray cells")
    return found


@pytest.mark.parametrize("index", range(len(HOSTILE)), ids=[h.name for h in HOSTILE])
def test_after_hostile_requests_the_server_answers_normally_and_holds_nothing(
    server, http, soak_client, baseline, index
):
    hostile = HOSTILE[index]
    for i in range(SLOTS + 1):
        record = soak_client.send(Action(i, -1, -1, "hostile", index, 2, 0.0, 0))
        assert record.as_expected, (
            f"{hostile.name}: {record.outcome} (status {record.status}, {record.code}), "
            f"expected {sorted(hostile.outcomes)}: {record.detail}\n{server.log_tail()}"
        )
    assert normal(http) == baseline  # answered, and the same greedy answer as before any hostile request
    health = server.health()  # at once: with nothing in flight, what it shows was read after the last release
    assert not held(health), held(health)
    assert health["status"] == "ok" and len(health["occupancy"]) == len(catalogue.DEFAULT_MODELS)
    assert all(o["slots"] == SLOTS for o in health["occupancy"].values()), health["occupancy"]


ROUNDS = 8  # a race: the more rounds, the likelier a regression shows
STAY = {
    "model": "segfuse",
    "messages": [{"role": "user", "content": "Count from one to one hundred."}],
    "max_tokens": 24,  # long enough that the streams overlap; the race is in how they end
    "temperature": 0,
    "stream": True,
    "segfuse": {"ignore_eos": True},
}


def text_of(line: str) -> str:
    """The answer text an SSE chunk carries (none in the role, usage or extension chunks)."""
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


def streams_at_once(server, http) -> tuple[list[dict], list[str]]:
    """Six streams at once (more than the slots): three hang up at their first text, the others read to the
    end, and the last of those to end asks /health at once. What /health said, and the streams' failures."""
    left = [3]  # the streams still to end that read their whole answer
    lock = threading.Lock()
    seen: list[dict] = []
    failures: list[str] = []

    def stream(leave: bool) -> None:
        try:
            with http.stream("POST", "/v1/chat/completions", json=STAY) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        break
                    if leave and line.startswith("data: ") and text_of(line):
                        return  # hangs up mid-answer
        except Exception as exc:  # reported by the test, not lost in its thread
            failures.append(f"{type(exc).__name__}: {exc}")
            return
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            seen.append(server.health())

    threads = [threading.Thread(target=stream, args=(i % 2 == 0,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    return seen, failures


def test_health_right_after_the_last_answer_shows_nothing_held(server, http):
    """Found after a hostile run: /health, asked the moment the last answer ended, showed a slot held with
    nothing in flight. Each round runs streams_at_once (many rounds later: the hung-up ones are long gone then)."""
    for round_no in range(ROUNDS):
        seen, failures = streams_at_once(server, http)
        assert not failures, failures
        assert len(seen) == 1 and not held(seen[0]), (round_no, held(seen[0]) if seen else "no answer")
