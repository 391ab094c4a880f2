"""The parts of `segfuse serve --ray` that need no cluster (pure logic): the metrics of several replicas
added up, the error events that end a stream whose replica died (each API's own, as the server itself
sends them), which members become Ray copies and what they ask for, and what the command refuses before
it starts anything. tests/test_ray_serve.py runs the whole on a real cluster."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed: pip install '.[ray]'")

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from segfuse.config import ConfigError, build_config
from segfuse.errors import InvalidRequestError
from segfuse.server.answer import Answer
from segfuse.server.chat.serving import ChatAnswer
from segfuse.server.completions.serving import CompletionAnswer
from segfuse.server.messages.protocol import error_body
from segfuse.server.messages.serving import MessagesAnswer
from segfuse.server.metrics import Families
from segfuse.server.ray.app import build
from segfuse.server.ray.board import merge, plain
from segfuse.server.ray.plan import copy_options, cpus_asked, plan
from segfuse.server.ray.run import check
from segfuse.server.ray.streams import EndStreams, answer_for, ending, lost
from segfuse.server.responses.serving import ResponsesAnswer

# --- metrics -------------------------------------------------------------------------------------------


def figures(requests: float, queued: float, free_slots: float) -> list:
    registry = CollectorRegistry()
    Counter("segfuse_requests", "r", registry=registry).inc(requests)
    Gauge("segfuse_queue_depth", "q", registry=registry).set(queued)
    Gauge("segfuse_member_free_slots", "f", ["member"], registry=registry).labels("a").set(free_slots)
    Counter("segfuse_member_faults", "x", ["member"], registry=registry).labels("a").inc(1)
    return plain(registry.collect())


def values(families) -> dict[str, float]:
    text = generate_latest(Families(families)).decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "_created" not in line
    }


def test_counters_and_gauges_add_up_over_replicas_and_the_copies_are_read_once():
    own, other, dead = figures(3, 1, 2), figures(4, 2, 2), figures(5, 7, 2)
    merged = values(merge(own, [(0.5, other), (60.0, dead)]))
    assert merged["segfuse_requests_total"] == 12  # a replica gone long ago keeps its requests counted
    assert merged["segfuse_queue_depth"] == 3  # ... but not its queue
    assert merged['segfuse_member_free_slots{member="a"}'] == 2  # the same copies: read by the scraped replica
    assert merged['segfuse_member_faults_total{member="a"}'] == 3  # each replica's own departures


def test_the_first_replica_of_a_series_says_when_it_began():
    own, other = figures(1, 0, 0), figures(1, 0, 0)
    created = next(s for s in other[0][3] if s[0].endswith("_created"))
    other[0][3][other[0][3].index(created)] = (created[0], created[1], created[2] - 100)
    merged = merge(own, [(0.1, other)])
    assert [s.value for s in merged[0].samples if s.name.endswith("_created")] == [created[2] - 100]


# --- the end of a broken stream -------------------------------------------------------------------------


def frames(data: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE frame."""
    out = []
    for block in data.decode().strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields.get("event"), fields["data"]))
    return out


def test_each_api_gets_its_own_error_event():
    openai_frames = frames(ending("/v1/chat/completions", None))
    assert openai_frames[-1] == (None, "[DONE]") and json.loads(openai_frames[0][1]) == lost().body()
    assert frames(ending("/v1/completions", None))[0] == openai_frames[0]
    messages = frames(ending("/v1/messages", None))
    assert messages == [("error", json.dumps(error_body(lost()), ensure_ascii=False))]
    responses = frames(ending("/v1/responses", 6))
    assert responses[0][0] == "error" and len(responses) == 1
    event = json.loads(responses[0][1])
    assert event["type"] == "error" and event["sequence_number"] == 7 and event["code"] == "replica_lost"


def test_the_answer_class_of_a_path_names_the_ending():
    """The proxy asks the class that serves a path (templates too) for its ending; another path gets OpenAI's."""
    assert answer_for("/v1/chat/completions") is ChatAnswer
    assert answer_for("/m/gemma3-270m/v1/completions") is answer_for("/v1/completions") is CompletionAnswer
    assert answer_for("/v1/messages/count_tokens") is answer_for("/v1/messages") is MessagesAnswer
    assert answer_for("/v1/responses") is ResponsesAnswer
    assert answer_for("/m//v1/completions") is answer_for("/v1/responses/x") is answer_for("/health") is Answer
    assert ending("/health", 3) == ending("/v1/chat/completions", None)


def run_asgi(app, path: str, disconnect: bool = False) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        if disconnect:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "path": path}, receive, send))
    return sent


def dying_stream(body: bytes, crash: bool, *, read: bool = False):
    async def app(scope, receive, send):
        if read:
            await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        if crash:
            raise RuntimeError("the replica died")

    return app


@pytest.mark.parametrize("crash", [False, True], ids=["returned", "raised"])
def test_an_unfinished_event_stream_is_ended_with_the_error_event(crash):
    first = b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n'
    sent = run_asgi(EndStreams(dying_stream(first, crash)), "/v1/responses")
    assert sent[-1]["more_body"] is False
    assert json.loads(frames(sent[-1]["body"])[0][1])["sequence_number"] == 1


def test_a_finished_stream_a_plain_response_and_a_client_gone_are_left_alone():
    async def finished(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    assert len(run_asgi(EndStreams(finished), "/v1/chat/completions")) == 2
    gone = run_asgi(
        EndStreams(dying_stream(b"data: {}\n\n", False, read=True)), "/v1/chat/completions", disconnect=True
    )
    assert len(gone) == 2

    async def plain_json(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})

    assert len(run_asgi(EndStreams(plain_json), "/v1/chat/completions")) == 2


def test_a_frame_cut_in_the_middle_is_closed_before_the_error():
    sent = run_asgi(EndStreams(dying_stream(b'data: {"choices"', False)), "/v1/chat/completions")
    assert sent[-1]["body"].startswith(b"\n\ndata: {")


# --- members, resources, refusals ---------------------------------------------------------------------


def test_each_member_becomes_copies_and_remote_members_stay_clients():
    config = build_config(
        models=[
            "smollm2-135m#replicas=2,cpus=0.5,slots=3",
            "ray:gemma3-270m#threads=2",
            "remote:http://127.0.0.1:9/v1#far",
        ],
        enabled=True,
        replicas=3,
        max_concurrent=2,
        frontend_cpus=0.25,
        threads=1,
    )
    planned = plan(config)
    assert [(p.inner, p.settings.replicas) for p in planned] == [
        ("smollm2-135m#slots=3", 2),
        ("gemma3-270m#threads=2", 1),
        (None, 1),
    ]
    assert copy_options(config).slots == 6  # a slot for each generation of each front end
    assert cpus_asked(config) == (3 * 0.25 + 2 * 0.5 + 2.0, 2.0)  # front ends, smollm2's copies, gemma's threads


def test_the_command_refuses_what_cannot_work_before_starting_anything():
    with pytest.raises(ConfigError, match="needs a port"):
        check(build_config(enabled=True, port=0))
    with pytest.raises(ConfigError, match=r"node_ip 127\.0\.0\.1"):
        check(build_config(enabled=True, node_ip="127.0.0.1"))
    with pytest.raises(InvalidRequestError, match="replicas must be at least 1"):
        check(build_config(enabled=True, models=["smollm2-135m#replicas=0"]))
    with pytest.raises(ConfigError, match=r"ray\.replicas"):
        build_config(enabled=True, replicas=0)


def test_the_application_builder_takes_serve_settings_and_a_config_file(tmp_path):
    path = tmp_path / "segfuse.toml"
    path.write_text('[server]\nport = 8100\n[members]\nmodels = ["smollm2-135m"]\n')
    application = build({"config": str(path), "replicas": 3, "threads": 1})
    front = application._bound_deployment
    assert front.name == "Front" and front.num_replicas == 3
    assert front.init_args[0]["server"]["port"] == 8100 and front.init_args[0]["ray"]["enabled"]
    with pytest.raises(ConfigError, match="unknown override 'bogus'"):
        build({"bogus": 1})


# --- a client gone ---------------------------------------------------------------------------------------


def test_a_request_serve_cancelled_reads_as_a_disconnect():
    """Serve's proxy cancels the request when its client goes away; the app must see ASGI's disconnect
    (its streams end the answer as cancelled), not Ray's error escaping as an unhandled one."""
    from ray.exceptions import TaskCancelledError

    from segfuse.server.ray.front import ReplicaHeader

    heard, sent = [], []

    async def app(scope, receive, send):
        heard.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive():
        raise TaskCancelledError()

    async def send(message):
        sent.append(message)

    asyncio.run(ReplicaHeader(app, "r1")({"type": "http"}, receive, send))
    assert heard == [{"type": "http.disconnect"}]
    assert (b"x-segfuse-replica", b"r1") in sent[0]["headers"]
