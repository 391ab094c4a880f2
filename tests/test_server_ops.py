"""Operating the server: Prometheus metrics at /metrics, and 400 for parameters segfuse does not implement.

The first tests need no models (the metrics object and the parameter tables alone); the rest
drive a real `segfuse serve` (tests/helpers.py) with the real `openai` client and raw
HTTP. Only two short completions run (max_tokens 4): refused requests never reach the members.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from helpers import live_server
from segfuse import models as catalogue
from segfuse.backends.base import Occupancy
from segfuse.config import build_config
from segfuse.server import parsing
from segfuse.server.app import create_app
from segfuse.server.chat.planning import CHAT
from segfuse.server.completions.serving import COMPLETIONS
from segfuse.server.metrics import OUTCOMES, ServerMetrics
from segfuse.types import Departure, Result, Stats
from streams import data_frames, stream_chat

MEMBERS = list(catalogue.DEFAULT_MODELS)
SAY_HI = [{"role": "user", "content": "Say hi."}]


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(sample name, labels): value}, through prometheus_client's own parser."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in metrics, f"no sample {name}{labels}; have {sorted(n for n, _ in metrics)}"
    return metrics[key]


# --------------------------------------------------------------------------- no models


class StubWorker:
    """What the metrics read from the worker, with made-up numbers."""

    max_concurrent = 3
    queue_size = 7

    def snapshot(self) -> dict[str, int]:
        return {
            "accepted": 9,
            "rejected": 1,
            "started": 8,
            "completed": 5,
            "cancelled": 1,
            "invalid": 1,
            "failed": 0,
            "rounds": 40,
        }

    def view(self) -> tuple[int, int, dict[str, Occupancy]]:
        held = {"a": Occupancy(slots=4, free_slots=3, cache_cells=57), "b": Occupancy()}  # b cannot tell
        return 2, 1, held


def test_metrics_read_the_worker_and_count_results():
    metrics, other = ServerMetrics(StubWorker()), ServerMetrics(StubWorker())  # per-app registries: no clash
    metrics.members(["a", "b"])
    result = Result(
        text="hi",
        segments=[],
        rounds=[],
        stats=Stats(tokens=7),
        models=["a", "b"],
        departures=[Departure("a", 1, "fault", "crashed"), Departure("b", 2, "exit", "agreed")],
    )
    metrics.first_segment(time.time() - 0.3)
    metrics.done(time.time() - 1.0, result)
    got = samples(metrics.render().decode())
    snapshot = StubWorker().snapshot()
    assert {o: value(got, "segfuse_requests_total", outcome=o) for o in OUTCOMES} == {o: snapshot[o] for o in OUTCOMES}
    assert value(got, "segfuse_rounds_total") == 40
    assert value(got, "segfuse_queue_depth") == 2 and value(got, "segfuse_generations_in_flight") == 1
    assert value(got, "segfuse_max_concurrent") == 3 and value(got, "segfuse_queue_capacity") == 7
    assert value(got, "segfuse_output_tokens_total") == 7
    assert value(got, "segfuse_request_latency_seconds_count") == 1
    assert value(got, "segfuse_request_latency_seconds_sum") == pytest.approx(1.0, abs=0.5)
    assert value(got, "segfuse_time_to_first_segment_seconds_count") == 1
    assert value(got, "segfuse_member_faults_total", member="a") == 1
    assert value(got, "segfuse_member_free_slots", member="a") == 3
    assert value(got, "segfuse_member_cache_cells", member="a") == 57
    assert ("segfuse_member_cache_cells", frozenset({("member", "b")})) not in got  # unknown is not 0
    assert value(got, "segfuse_member_faults_total", member="b") == 0  # started at 0 by members()
    assert value(got, "segfuse_member_exits_total", member="b") == 1
    assert value(samples(other.render().decode()), "segfuse_output_tokens_total") == 0
    apps = [create_app(build_config()) for _ in range(2)]  # two apps in one process: two registries
    assert apps[0].state.segfuse.metrics.registry is not apps[1].state.segfuse.metrics.registry


NEUTRAL = {
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logprobs": False,
    "top_logprobs": None,
    "logit_bias": {},
    "tools": [],
    "tool_choice": "none",
    "functions": None,
    "function_call": None,
    "response_format": {"type": "text"},
    "modalities": ["text"],
    "audio": None,
    "n": 1,
    "metadata": {"team": "ops"},
    "store": False,
    "service_tier": "auto",
    "parallel_tool_calls": True,
}
REFUSED = {
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "logit_bias": {"50256": -100},
    "frequency_penalty": 0.5,
    "presence_penalty": -1,
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "bogus_field": 1,
    "window": 6,
}


def test_parameter_tables():
    assert parsing.unsupported({"messages": SAY_HI, "max_tokens": 4, "segfuse": {"window": 4}, **NEUTRAL}, CHAT) == []
    for name, bad in REFUSED.items():
        assert parsing.unsupported({"messages": SAY_HI, name: bad}, CHAT) == [name], name
    # strict: a boolean is not a number and a number is not a boolean
    assert parsing.unsupported({"presence_penalty": False, "frequency_penalty": False}, CHAT) == [
        "presence_penalty",
        "frequency_penalty",
    ]
    # /v1/completions has its own table: suffix and best_of pass only at their neutral values
    text = {"prompt": "Once", "echo": False, "logprobs": 2, "suffix": "", "best_of": 1, "frequency_penalty": 0}
    assert parsing.unsupported(text, COMPLETIONS) == []
    assert parsing.unsupported({"prompt": "Once", "suffix": "end", "best_of": 3, "messages": SAY_HI}, COMPLETIONS) == [
        "suffix",
        "best_of",
        "messages",
    ]
    error = parsing.unsupported_error(["window"], CHAT)
    assert error.status == 400 and error.detail.param == "window" and "'segfuse' object" in error.detail.message


def test_request_options_go_over_the_defaults_and_an_explicit_null_is_kept():
    from segfuse.options import FusionOptions

    defaults = FusionOptions.build(max_tokens=64, accept_margin=2.0)
    request = parsing.parse_request(
        json.dumps(
            {"messages": SAY_HI, "max_tokens": 8, "temperature": None, "segfuse": {"accept_margin": None, "gate": 0.7}}
        ).encode(),
        CHAT,
    )
    options = parsing.fusion_options(request, defaults)
    assert (options.max_tokens, options.temperature, options.gate) == (8, defaults.temperature, 0.7)
    assert options.accept_margin is None  # null: every proposal goes to the vote, not the server's default


# --------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = [n for n in MEMBERS if not catalogue.is_ready(catalogue.CATALOGUE[n])]
    if missing:
        pytest.fail(f"models not prepared: {missing}; run `make models`", pytrace=False)
    with live_server(tmp_path_factory.mktemp("ops"), queue_size=4) as running:
        yield running
        assert running.health()["counters"]["failed"] == 0, running.log_tail()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.api, api_key=server.api_key, max_retries=0, timeout=300)


def scrape(server) -> dict:
    # With the key, as a Prometheus scrape config's bearer token sends it: the per-member series need it.
    response = httpx.get(f"{server.url}/metrics", timeout=10, headers={"Authorization": f"Bearer {server.api_key}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return samples(response.text)


@pytest.mark.models
@pytest.mark.timeout(600)
def test_metrics_move_after_a_completion_with_neutral_parameters(server, client):
    before = scrape(server)
    answer = client.chat.completions.create(
        model="segfuse",
        messages=SAY_HI,
        max_tokens=4,
        temperature=0,
        # OpenAI parameters at their neutral values, and harmless ones: accepted
        frequency_penalty=0,
        presence_penalty=0,
        logprobs=False,
        n=1,
        response_format={"type": "text"},
        logit_bias={},
        metadata={"test": "ops"},
        extra_body={"tools": [], "tool_choice": None},
    )
    tokens = answer.usage.completion_tokens
    assert answer.choices[0].finish_reason in ("stop", "length") and tokens > 0
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - before.get((name, frozenset(labels.items())), 0.0)

    assert moved("segfuse_requests_total", outcome="completed") == 1
    assert all(moved("segfuse_requests_total", outcome=o) == 0 for o in OUTCOMES if o != "completed")
    assert moved("segfuse_output_tokens_total") == tokens
    assert moved("segfuse_request_latency_seconds_count") == 1
    assert moved("segfuse_time_to_first_segment_seconds_count") == 1
    assert moved("segfuse_rounds_total") >= 1
    assert value(after, "segfuse_generations_in_flight") == 0 and value(after, "segfuse_queue_depth") == 0
    for member in MEMBERS:  # every member has its series, at 0 unless one left a query
        value(after, "segfuse_member_faults_total", member=member)
    # the counters are /health's
    health = server.health()
    assert {o: value(after, "segfuse_requests_total", outcome=o) for o in OUTCOMES} == {
        o: health["counters"][o] for o in OUTCOMES
    }
    assert value(after, "segfuse_max_concurrent") == health["queue"]["max_concurrent"]


@pytest.mark.models
@pytest.mark.timeout(600)
def test_a_stream_with_neutral_parameters_is_observed(server):
    before = scrape(server)
    body = {
        "messages": SAY_HI,
        "max_tokens": 4,
        "stream": True,
        "logit_bias": None,
        "tools": [],
        "modalities": ["text"],
        "top_logprobs": None,
        "presence_penalty": 0.0,
        "store": True,
    }
    with stream_chat(server, body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        frames = list(data_frames(response))
    assert frames[-1] == "[DONE]"
    after = scrape(server)
    assert (
        value(after, "segfuse_request_latency_seconds_count")
        == value(before, "segfuse_request_latency_seconds_count") + 1
    )
    assert (
        value(after, "segfuse_requests_total", outcome="completed")
        == value(before, "segfuse_requests_total", outcome="completed") + 1
    )


RAW_REFUSED = ["functions", "function_call", "logit_bias", "frequency_penalty", "modalities", "bogus_field"]


@pytest.mark.models
@pytest.mark.parametrize("name", RAW_REFUSED)
def test_unsupported_parameter_gets_400_naming_it(server, name):
    accepted = server.health()["counters"]["accepted"]
    response = httpx.post(
        f"{server.api}/chat/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"},
        content=json.dumps({"messages": SAY_HI, "max_tokens": 4, name: REFUSED[name]}),
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_parameter"
    assert error["param"] == name and repr(name) in error["message"] and "Supported parameters" in error["message"]
    assert server.health()["counters"]["accepted"] == accepted  # refused before the queue


@pytest.mark.models
def test_openai_client_sees_bad_request(client):
    cases = {
        "functions": {"extra_body": {"functions": [{"name": "f"}]}},
        "presence_penalty": {"presence_penalty": 0.5},
        "bogus_field": {"extra_body": {"bogus_field": 1}},
        "window": {"extra_body": {"window": 6}},
    }
    for name, extra in cases.items():
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="segfuse", messages=SAY_HI, max_tokens=4, **extra)
        assert caught.value.code == "unsupported_parameter" and caught.value.param == name, caught.value
    assert "'segfuse' object" in caught.value.message  # the last case: a fusion option at the top level
