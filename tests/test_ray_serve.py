"""`segfuse serve --ray` on a real two-node Ray cluster on loopback (tests/ray_cluster.py: head 127.0.0.2, a
node 127.0.0.3), with the embedded members as Ray copies and two front-end replicas behind Serve's proxy on
127.0.0.1, driven by the real `openai` and `anthropic` clients and httpx:

- greedy answers byte-identical to a single-process server over the same members in the same run (no
  prefix cache on either side) on chat, text completions, echo, Messages and Responses, streamed and
  whole; the same refusal of a bad request, the same web view;
- copies on both nodes (read from /health), one metrics total whichever replica /metrics reaches;
- a previous_response_id chain, and Hedge weights carried, across the two replicas;
- a member copy killed mid-stream: the answer completes, the same; Ray restarts the copy;
- a front-end replica killed mid-stream: its stream ends with an error event, the other replica
  answers, Serve brings the replica back;
- the second node leaves: /health says so while its copies and replica move to the head, then all is
  well again and the server answers;
- SIGTERM: the application's processes are gone, and then the cluster's; a local instance (`--ray` alone)
  started and stopped by the command leaves nothing either; a port in use ends it with status 3.

The command runs as a subprocess that joins the cluster (``[ray] address``), as an operator would run it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import psutil
import pytest

from helpers import wait_for
from live_app import serve_app
from ray_cluster import HEAD, WORKER, LoopbackCluster
from segfuse import Ensemble
from segfuse.bench.common.processes import segfuse_server
from segfuse.config import ServerConfig
from segfuse.models import DEFAULT_MODELS

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install '.[ray]'")

from segfuse.server.ray.front import REPLICA_HEADER  # noqa: E402  # it imports ray: after the skip

pytestmark = [pytest.mark.models, pytest.mark.timeout(1200)]

KEY = "ray-serve-key"
SMALL = "smollm2-135m"
MEMBERS = {"threads": 1, "prefix_cache_cells": 0, "n_ctx": 1024}  # both sides: one thread, no prefix cache
SERVER = {"api_key": KEY, "max_concurrent": 2, "queue_size": 8, "log_level": "warning", "hedge_persist": True}
REPLICAS = 2
SLOTS = SERVER["max_concurrent"] * REPLICAS  # what each Ray copy holds; the local members hold as many
CONFIG = {
    "server": SERVER,
    "members": MEMBERS,
    "limits": {"max_tokens": 64},
    "defaults": {"max_tokens": 10, "temperature": 0},
}
COPY = "cpus=0.25"  # each copy asks Ray for a quarter CPU (it runs one thread): all fit on 2 x 2 CPUs
RAY_MODELS = [f"{SMALL}#replicas=2,{COPY}", *[f"{name}#{COPY}" for name in DEFAULT_MODELS if name != SMALL]]
PLAIN = {"gate": None, "window": 4}  # every member drafts every round (no streamed drafts): many short rounds
CHAT = [{"role": "user", "content": "Name three primary colors."}]
AUTH = {"Authorization": f"Bearer {KEY}"}
APP_PROCESSES = ("ray::MemberHost", "ray::SharedState", "ray::ServeReplica", "ray::ServeController", "ray::ProxyActor")


@pytest.fixture(scope="module")
def cluster():
    running = LoopbackCluster().start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def ray_server(cluster, tmp_path_factory):
    config = {
        **CONFIG,
        "members": {**MEMBERS, "models": RAY_MODELS},
        "ray": {"address": cluster.address, "node_ip": HEAD, "replicas": REPLICAS, "frontend_cpus": 0.25},
    }
    with segfuse_server(
        tmp_path_factory.mktemp("ray"), "ray-serve", config, startup_s=420, extra_args=("--ray",)
    ) as running:
        yield running


@pytest.fixture(scope="module")
def local_server():
    """The same members in this process, served as `segfuse serve` serves them."""
    config = ServerConfig.model_validate({**CONFIG, "server": {**SERVER, "port": 0}})
    ensemble = Ensemble(list(DEFAULT_MODELS), hedge_persist=True, slots=SLOTS, **MEMBERS)
    try:
        with serve_app(config, ensemble) as (url, state):
            yield url
            assert state.worker.queue.snapshot()["failed"] == 0
    finally:
        ensemble.close()


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def health(url: str) -> dict:
    response = httpx.get(f"{url}/health", headers=AUTH, timeout=60)
    assert response.json()["replica"] == response.headers.get(REPLICA_HEADER)
    return response.json()


# --- the same answers ------------------------------------------------------------------------------


def answers(url: str) -> dict:
    """One greedy answer of each API, reduced to what must not differ between two servers."""
    client = oai(url)
    chat = client.chat.completions.create(model="segfuse", messages=CHAT)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="segfuse", messages=CHAT, stream=True)
        if c.choices
    )
    text = client.completions.create(model="segfuse", prompt="Once upon a time", extra_body={"segfuse": PLAIN})
    echo = client.completions.create(model="segfuse", prompt="The sky is blue", echo=True, logprobs=2, max_tokens=0)
    messages = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300).messages.create(
        model="segfuse", max_tokens=10, messages=CHAT
    )
    response = client.responses.create(model="segfuse", input="Say hello politely.", max_output_tokens=10)
    events = [
        e.type
        for e in client.responses.create(
            model="segfuse", input="Say hello politely.", max_output_tokens=10, stream=True
        )
    ]
    refused = httpx.post(
        f"{url}/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={"model": "segfuse", "messages": CHAT, "max_tokens": 10_000},
    )
    return {
        "chat": (
            chat.choices[0].message.content,
            chat.choices[0].finish_reason,
            chat.usage.completion_tokens,
            [s["model"] for s in chat.model_extra["segfuse"]["segments"]],
        ),
        "chat streamed": streamed,
        "text": (text.choices[0].text, text.choices[0].finish_reason),
        "echo": echo.choices[0].logprobs.model_dump(),
        "messages": ([b.text for b in messages.content], messages.stop_reason, messages.usage.output_tokens),
        "responses": (response.output_text, response.status),
        "responses streamed": events,
        "refused": (refused.status_code, refused.json()),
        "web view": httpx.get(f"{url}/", timeout=60).text,
    }


def test_answers_equal_a_single_process_server(ray_server, local_server):
    got, expected = answers(ray_server.url), answers(local_server)
    assert got["chat"][0].strip() and got["text"][0].strip() and got["messages"][0][0].strip()
    assert got["echo"]["tokens"] and got["refused"][0] == 400 and "<html" in got["web view"].lower()
    for api in expected:
        assert got[api] == expected[api], api
    assert got["chat"][0] == got["chat streamed"]


# --- where things run, and the figures -----------------------------------------------------------------


def test_copies_run_on_both_nodes_and_health_names_each(ray_server):
    seen = health(ray_server.url)
    assert seen["status"] == "ok" and seen["degraded"] == [] and seen["replica"]
    copies = seen["copies"]
    assert set(copies) == set(DEFAULT_MODELS) and len(copies[SMALL]) == 2
    rows = [row for member in copies.values() for row in member]
    assert {row["node_ip"] for row in rows} == {HEAD, WORKER}
    assert {row["node_ip"] for row in copies[SMALL]} == {HEAD, WORKER}  # its two copies spread over the nodes
    assert all(row["up"] and row["slots"] == SLOTS and row["prefix_hits"] == 0 for row in rows)
    assert all(row["free_slots"] == SLOTS and row["waiting"] == 0 and row["sessions"] == 0 for row in rows)


def by_replica(url: str, path: str, want: int = REPLICAS, within_s: float = 60) -> dict[str, httpx.Response]:
    """`path` asked until `want` replicas answered (the proxy learns of a new replica within seconds): each
    one's last response."""
    seen: dict[str, httpx.Response] = {}

    def answered() -> bool:
        response = httpx.get(f"{url}{path}", headers=AUTH, timeout=60)
        seen[response.headers[REPLICA_HEADER]] = response
        return len(seen) >= want

    wait_for(answered, within_s, 0.1, f"{want} replicas to answer {path}")
    return seen


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def test_metrics_report_one_total_whichever_replica_answers(ray_server):
    """Every replica's /metrics says the requests completed on all of them (each /health counts its own)."""
    oai(ray_server.url).chat.completions.create(model="segfuse", messages=CHAT, max_tokens=2)
    time.sleep(2)  # each replica publishes its figures every second
    own = {replica: r.json()["counters"]["completed"] for replica, r in by_replica(ray_server.url, "/health").items()}
    total = sum(own.values())
    scraped = by_replica(ray_server.url, "/metrics")
    completed = 'segfuse_requests_total{outcome="completed"}'
    assert {replica: metric(r.text, completed) for replica, r in scraped.items()} == dict.fromkeys(scraped, total)
    text = next(iter(scraped.values())).text
    assert metric(text, "segfuse_max_concurrent") == SERVER["max_concurrent"] * REPLICAS
    for name in ("segfuse_member_copy_up", "segfuse_member_copy_free_slots"):
        rows = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert len(rows) == 4 and f'node="{WORKER}"' in "".join(rows), rows  # a row per copy, on both nodes


# --- what the replicas share ----------------------------------------------------------------------------


def test_a_previous_response_chain_goes_across_the_replicas(ray_server):
    """Each link continues the one before, whichever replica stored it: until a link is answered by another
    replica than the one that answered the link before it."""
    client = oai(ray_server.url)
    raw = client.responses.with_raw_response.create(model=SMALL, input="Count: one.", max_output_tokens=4)
    previous, replicas = raw.parse(), [raw.headers[REPLICA_HEADER]]
    for turn in range(12):
        raw = client.responses.with_raw_response.create(
            model=SMALL, input=f"And {turn}?", max_output_tokens=4, previous_response_id=previous.id
        )
        previous = raw.parse()
        assert previous.status in ("completed", "incomplete") and previous.previous_response_id
        replicas.append(raw.headers[REPLICA_HEADER])
        if replicas[-1] != replicas[-2]:
            break
    assert len(set(replicas)) == 2 and replicas[-1] != replicas[-2], replicas
    assert previous.usage.input_tokens > 20  # it read the whole chain


def hedged(url: str) -> tuple[dict, str]:
    raw = oai(url).chat.completions.with_raw_response.create(
        model="segfuse", messages=CHAT, max_tokens=8, extra_body={"segfuse": {**PLAIN, "hedge": True}}
    )
    return raw.parse().model_extra["segfuse"]["weights"], raw.headers.get(REPLICA_HEADER)


def test_hedge_weights_carry_from_one_replica_to_the_next(ray_server, local_server):
    """With hedge_persist, each query starts from the weights the last one ended with, whichever replica
    answered it: the Ray server's weights, request after request, are the single-process server's."""
    weights, replicas = [], []
    while len(replicas) < 2 or replicas[-1] == replicas[-2]:
        assert len(replicas) < 12, replicas
        found, replica = hedged(ray_server.url)
        weights.append(found)
        replicas.append(replica)
    expected = [hedged(local_server)[0] for _ in weights]
    assert weights == expected and weights[-1] != weights[-2]  # the weights move: the last started from the others


# --- faults ------------------------------------------------------------------------------------------


def stream_lines(url: str, body: dict):
    """A streamed chat request's response and its SSE data lines (a generator)."""
    client = httpx.Client(timeout=300)
    request = client.build_request(
        "POST",
        f"{url}/v1/chat/completions",
        headers=AUTH,
        json={"model": "segfuse", "messages": CHAT, "stream": True, **body},
    )
    response = client.send(request, stream=True)
    return response, (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))


def text_of(lines) -> tuple[str, list[dict]]:
    """The streamed text so far and every chunk, read to the end."""
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")), chunks


def test_a_copy_killed_mid_stream_the_answer_completes_the_same(ray_server, local_server):
    body = {"max_tokens": 24, "segfuse": PLAIN}
    expected = (
        oai(local_server)
        .chat.completions.create(model="segfuse", messages=CHAT, max_tokens=24, extra_body={"segfuse": PLAIN})
        .choices[0]
        .message.content
    )
    response, lines = stream_lines(ray_server.url, body)
    first = ""
    for line in lines:
        first += json.loads(line)["choices"][0]["delta"].get("content") or ""
        if first:
            break
    busy = [row for row in health(ray_server.url)["copies"][SMALL] if row["sessions"] > 0]
    assert len(busy) == 1, busy
    os.kill(busy[0]["pid"], signal.SIGKILL)
    rest, chunks = text_of(lines)
    response.close()
    assert first + rest == expected and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in c for c in chunks)
    wait_for(
        lambda: (
            all(r["up"] and r["pid"] != busy[0]["pid"] for r in health(ray_server.url)["copies"][SMALL])
            and not health(ray_server.url)["degraded"]
        ),
        120,
        1.0,
        "Ray to restart the killed copy",
    )


def front_replicas_running() -> int:
    from ray import serve

    return serve.status().applications["segfuse"].deployments["Front"].replica_states.get("RUNNING", 0)


def test_a_front_end_replica_killed_mid_stream_its_stream_ends_with_an_error(ray_server):
    response, lines = stream_lines(ray_server.url, {"max_tokens": 48, "segfuse": PLAIN})
    next(lines)  # the stream began
    replica = response.headers[REPLICA_HEADER]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::segfuse#Front#{replica}", namespace="serve"), no_restart=True)
    rest = list(lines)
    response.close()
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "replica_lost" and "retry" in error["message"]
    answer = oai(ray_server.url).chat.completions.with_raw_response.create(model=SMALL, messages=CHAT, max_tokens=4)
    assert answer.parse().choices[0].message.content and answer.headers[REPLICA_HEADER] != replica
    wait_for(lambda: front_replicas_running() == REPLICAS, 180, 1.0, "Serve to bring the replica back")
    new = by_replica(ray_server.url, "/health")
    assert replica not in new and all(r.json()["status"] == "ok" for r in new.values())


def test_a_node_that_leaves_its_copies_restart_elsewhere_while_health_says_so(ray_server, cluster):
    _, worker = cluster.cluster.list_all_nodes()
    assert worker.node_ip_address == WORKER
    cluster.cluster.remove_node(worker)
    said: set[str] = set()

    def moved() -> bool:
        seen = health(ray_server.url)
        said.update(seen["degraded"])
        rows = [row for member in seen["copies"].values() for row in member]
        return all(row["up"] and row["node_ip"] == HEAD for row in rows) and not seen["degraded"]

    wait_for(moved, 300, 1.0, "the copies to restart on the head node")
    assert any(f"node {WORKER} left" in line for line in said), said
    assert any("is down" in line for line in said), said
    assert oai(ray_server.url).chat.completions.create(model="segfuse", messages=CHAT).choices[0].message.content
    wait_for(lambda: front_replicas_running() == REPLICAS, 180, 1.0, "Serve to start the lost replica again")


# --- the end ----------------------------------------------------------------------------------------------


def app_processes(cluster: LoopbackCluster) -> list[tuple[int, str]]:
    """The application's Ray processes (by their titles: a process's name is cut at 15 characters)."""
    found = []
    for proc in cluster.note():
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if title.startswith(APP_PROCESSES):
            found.append((proc.pid, title))
    return found


def test_sigterm_removes_the_application_and_the_cluster_leaves_nothing(ray_server, cluster):
    assert any(title.startswith("ray::MemberHost") for _, title in app_processes(cluster))
    ray_server.process.send_signal(signal.SIGTERM)
    assert ray_server.process.wait(120) == 0, ray_server.log_tail()
    wait_for(lambda: not app_processes(cluster), 60, 0.5, "the application's processes to end")
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {HEAD}  # the cluster stays
    left = cluster.stop()
    assert not left, [(p.pid, p.name()) for p in left]


def test_a_local_instance_is_started_and_stopped_by_the_command(tmp_path: Path):
    """`--ray` without an address: the command's own Ray instance (node 127.0.0.2), stopped on SIGINT."""
    config = {"server": SERVER, "members": {**MEMBERS, "models": [SMALL]}, "defaults": CONFIG["defaults"]}
    with segfuse_server(tmp_path, "ray-local", config, startup_s=300, extra_args=("--ray",)) as running:
        seen = health(running.url)
        assert [row["node_ip"] for row in seen["copies"][SMALL]] == ["127.0.0.2"]
        assert oai(running.url).chat.completions.create(model=SMALL, messages=CHAT).choices[0].message.content
        processes = psutil.Process(running.process.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in processes) and any("gcs_server" in p.name() for p in processes)
        running.process.send_signal(signal.SIGINT)
        assert running.process.wait(120) == 0, running.log_tail()
        _, alive = psutil.wait_procs(processes, timeout=60)
        assert not alive, [(p.pid, p.name()) for p in alive]


def test_a_port_in_use_ends_the_command_with_status_3_saying_so():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "segfuse.cli", "serve", "--ray", "--port", str(port), "-m", SMALL, "--threads", "1"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert result.returncode == 3, result.stderr[-2000:]
    assert f"could not listen on 127.0.0.1:{port}" in result.stdout + result.stderr
