"""Pure logic of a server of several models: names, keep-alive durations, sizes, the config's checks."""

import asyncio
import math
import threading
import time
from types import SimpleNamespace

import pytest

from segfuse.config import ConfigError, build_config, byte_count, ensemble_flags, split_members
from segfuse.errors import InvalidRequestError, UnknownModelError
from segfuse.keep_alive import FOREVER, describe_keep_alive, keep_alive_seconds
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest

pytest.importorskip("fastapi")
from segfuse.server.models import changes as changes_module
from segfuse.server.models.catalog import Catalog, spec_name
from segfuse.server.models.pool import (
    Budget,
    Changes,
    Lease,
    LoadFailedError,
    MemberFreedError,
    NoRoomError,
    Place,
    Pool,
)
from segfuse.server.serving import api_error
from segfuse.server.state import job_for
from segfuse.server.worker.jobs import QueueFullError
from segfuse.server.worker.thread import Worker


def test_a_member_is_named_by_its_spec_as_its_backend_would_name_it():
    assert spec_name("smollm2-135m") == "smollm2-135m"
    assert spec_name("/models/Qwen2.5-7B-Q4_K_M.gguf") == "Qwen2.5-7B-Q4_K_M"
    assert spec_name("transformers:/models/Qwen2.5-7B#device=cuda:0,dtype=bf16") == "Qwen2.5-7B"
    assert spec_name("transformers:/models/x#coder,device=cpu") == "coder"
    assert spec_name("llama_cpp:gemma3-270m") == "gemma3-270m"
    assert spec_name("remote:http://127.0.0.1:8000/v1#big") == "big"
    assert spec_name("hf:org/repo:Q4_K_M") == "hf:org/repo:Q4_K_M"


def test_ensemble_flags_keep_a_specs_options_together_and_refuse_what_is_not_name_equals_specs():
    assert split_members("a,transformers:x#device=cuda:0,dtype=bf16,b") == [
        "a",
        "transformers:x#device=cuda:0,dtype=bf16",
        "b",
    ]
    assert ensemble_flags(["small=smollm2-135m,gemma3-270m"]) == {"small": ["smollm2-135m", "gemma3-270m"]}
    for bad in ("small", "=a,b", "small="):
        with pytest.raises(ConfigError, match="NAME=SPEC"):
            ensemble_flags([bad])


def test_keep_alive_is_read_as_ollama_reads_it():
    assert keep_alive_seconds("5m") == 300
    assert keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds("250ms") == 0.25
    assert keep_alive_seconds(0) == 0 and keep_alive_seconds("0") == 0
    assert keep_alive_seconds(-1) == FOREVER and keep_alive_seconds("-1m") == FOREVER
    assert keep_alive_seconds(12.5) == 12.5
    for bad in ("soon", "5 parsecs", "m5", True, math.nan, 10**400, -(10**22), math.inf, "1e400"):
        with pytest.raises(InvalidRequestError, match="keep_alive"):
            keep_alive_seconds(bad)
    assert [describe_keep_alive(s) for s in (FOREVER, 0, 300, 5400, 2.5)] == ["forever", "0s", "5m", "1h30m", "2.5s"]


def test_sizes_are_read_with_their_units():
    assert byte_count("12GiB") == 12 * 2**30
    assert byte_count("800MB") == 800 * 10**6
    assert byte_count(1024) == 1024
    for bad in ("lots", "-1GB", 0, "12 parsecs"):
        with pytest.raises(InvalidRequestError):
            byte_count(bad)


def test_two_ensembles_share_one_member_under_one_name_and_each_member_is_a_model():
    config = build_config(
        ensembles={
            "small": ["smollm2-135m", "gemma3-270m"],
            "full": ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"],
        }
    )
    catalog = Catalog.of(config)
    assert catalog.ensembles == ["small", "full"] and catalog.default == "small" and catalog.preload == ["small"]
    assert catalog.models["full"].members == ("qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m")
    assert set(catalog.specs) == {"qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"}
    assert catalog.holders("smollm2-135m") == ["small", "full"]
    assert catalog.model("gemma3-270m").members == ("gemma3-270m",) and not catalog.model("gemma3-270m").ensemble
    assert catalog.model(None).name == "small"
    with pytest.raises(UnknownModelError) as caught:
        catalog.model("large")
    error = api_error(caught.value, detailed=True)  # as the server's edge (state.using) maps it
    assert error.status == 404 and "small, full" in str(error.body())
    assert (error.detail.type, error.detail.code, error.detail.param) == (
        "invalid_request_error",
        "model_not_found",
        "model",
    )


def test_the_models_errors_reach_a_client_with_their_status_type_code_and_param():
    """The catalog and the pool raise domain errors; the server's edge (``api_error``) gives each its HTTP face."""
    cases = [
        (UnknownModelError("unknown model 'x'"), 404, "invalid_request_error", "model_not_found", "model"),
        (QueueFullError("9 requests are waiting for models to load"), 429, "rate_limit_error", "queue_full", None),
        (MemberFreedError("member m was freed and cannot be loaded again"), 503, "server_error", None, None),
        (
            LoadFailedError("could not load member m of model s: gone"),
            503,
            "server_error",
            "model_load_failed",
            "model",
        ),
        (NoRoomError("model s does not fit the memory budget"), 503, "server_error", "no_room", None),
    ]
    for exc, status, kind, code, param in cases:
        error = api_error(exc, detailed=True)
        assert (error.status, error.detail.type, error.detail.code, error.detail.param) == (status, kind, code, param)
        assert error.detail.message == exc.message  # the text as written, nothing added


def test_a_request_has_one_deadline_read_once_for_its_members_wait_and_its_jobs():
    catalog = Catalog.of(build_config(ensembles={"small": ["smollm2-135m", "gemma3-270m"]}))
    before = time.monotonic()
    lease = Lease(SimpleNamespace(catalog=catalog), catalog.model("small"), None, 30.0)
    assert before <= lease.arrived <= time.monotonic() and lease.deadline == lease.arrived + 30.0
    request = FusionRequest.of("Hi", FusionOptions())
    first = job_for(request, lease)
    time.sleep(0.01)  # a later job of the same request (a text completion's next prompt) keeps the same deadline
    second = job_for(request, lease, id="second")
    assert first.fusion.deadline == second.fusion.deadline == lease.deadline
    assert first.accepted_at == second.accepted_at == lease.arrived  # the deadline counts from when it arrived
    assert Lease(SimpleNamespace(catalog=catalog), catalog.model("small"), None, None).deadline is None


def test_one_spec_twice_in_an_ensemble_is_two_members():
    catalog = Catalog.of(build_config(models=["smollm2-135m", "smollm2-135m"]))
    assert catalog.models["segfuse"].members == ("smollm2-135m", "smollm2-135m#2")
    assert catalog.single()


def test_an_ensembles_defaults_go_over_the_servers_and_a_profiles_under_its_own(tmp_path):
    profile = tmp_path / "small.toml"
    profile.write_text('[fusion]\nwindow = 6\ngate = "none"\n')
    config = build_config(defaults={"max_tokens": 40, "window": 8})
    config = build_config(
        defaults={"max_tokens": 40, "window": 8},
        ensembles={"small": ["smollm2-135m", "gemma3-270m"]},
    )
    assert config.ensemble_defaults("small").window == 8
    path = tmp_path / "segfuse.toml"
    path.write_text(
        f'[defaults]\nmax_tokens = 40\n\n[ensembles.small]\nmembers = ["smollm2-135m", "gemma3-270m"]\n'
        f'profile = "{profile}"\ndefaults = {{ window = 4 }}\n'
    )
    small = build_config(path).ensemble_defaults("small")
    assert (small.window, small.gate, small.max_tokens) == (4, None, 40)


def test_the_config_refuses_what_several_models_cannot_do():
    two = {"small": ["smollm2-135m"], "full": ["smollm2-135m", "gemma3-270m"]}
    with pytest.raises(ConfigError, match="hedge_persist"):
        build_config(ensembles=two, hedge_persist=True)
    with pytest.raises(ConfigError, match="Ray server serves one ensemble"):
        build_config(ensembles=two, enabled=True)
    with pytest.raises(ConfigError, match="preload names 'large'"):
        build_config(ensembles=two, preload=["large"])
    with pytest.raises(ConfigError, match="keep_alive"):
        build_config(keep_alive="soon")
    assert build_config(ensembles=two, preload=[]).preloaded() == []


def test_the_budget_counts_what_is_loaded_loading_or_not_yet_closed():
    places = [Place("a", "a", state="loaded", nbytes=600), Place("b", "b", state="unloading", nbytes=300)]
    places.append(Place("c", "c", state="unloaded", nbytes=900))
    assert not Budget(members=2).over(places)
    assert Budget(members=2).over(places, [places[2]])
    assert Budget(nbytes=1000).over(places, [places[2]])
    assert not Budget(nbytes=1000).over(places)
    assert not Budget().over(places, [places[2]])


def test_a_budget_smaller_than_an_ensemble_is_refused_at_start():
    with pytest.raises(ConfigError, match="'full' has 3 members and \\[server\\] max_loaded_members is 2"):
        build_config(ensembles={"full": ["a", "b", "c"], "one": ["a"]}, max_loaded_members=2)
    with pytest.raises(ConfigError, match="has 3 members"):  # the embedded three
        build_config(max_loaded_members=2)


class FakeMember:
    """What the pool needs of a member: a name, its bytes, and close."""

    def __init__(self, spec: str) -> None:
        self.name, self.nbytes, self.closed = spec, 100, False

    def close(self) -> None:
        self.closed = True


def two_models_one_room() -> tuple[Catalog, Pool]:
    """Two one-member models and room for one member: the second waits until the first's is let go."""
    catalog = Catalog.of(build_config(ensembles={"a": ["smollm2-135m"], "b": ["gemma3-270m"]}, preload=[]))
    return catalog, Pool(catalog, Worker(4), FakeMember, Budget(members=1), keep_alive_s=60.0)


def test_the_pool_wakes_its_waiter_when_another_thread_changes_it_not_at_a_poll(monkeypatch):
    monkeypatch.setattr(changes_module, "WAKE_S", 30.0)  # a missed wake-up would wait this long: the test says so
    changes = Changes()
    seen: list[int] = []

    async def wait(deadline_s: float | None) -> tuple[bool, float]:
        start = time.monotonic()
        deadline = None if deadline_s is None else start + deadline_s
        woke = await changes.until(lambda: bool(seen), deadline)
        return woke, time.monotonic() - start

    assert asyncio.run(wait(0.2))[0] is False  # nothing changed: its deadline ends the wait
    threading.Timer(0.2, lambda: (seen.append(1), changes.tell())).start()
    woke, waited = asyncio.run(wait(None))
    assert woke and waited < 5.0


def test_a_request_waiting_for_room_loads_once_a_job_on_another_thread_lets_its_member_go(monkeypatch):
    monkeypatch.setattr(changes_module, "WAKE_S", 30.0)
    catalog, pool = two_models_one_room()

    async def scenario() -> float:
        async with pool.lease(catalog.model("a"), None, None) as first:
            let_go = first.hold()  # a's job: it holds the member past the request
        threading.Timer(0.2, let_go).start()  # the worker thread lets the job go
        start = time.monotonic()
        async with pool.lease(catalog.model("b"), None, None):
            return time.monotonic() - start

    waited = asyncio.run(scenario())
    assert 0.15 < waited < 5.0, waited  # it waited for the job, and no longer
    assert {p.name: p.state for p in pool.snapshot()} == {"smollm2-135m": "unloaded", "gemma3-270m": "loaded"}


def test_a_request_that_finds_no_room_by_its_deadline_gets_no_room(monkeypatch):
    monkeypatch.setattr(changes_module, "WAKE_S", 30.0)
    catalog, pool = two_models_one_room()

    async def scenario() -> None:
        async with pool.lease(catalog.model("a"), None, None) as first:
            first.hold()  # held for ever
        async with pool.lease(catalog.model("b"), None, 0.3):
            pass

    start = time.monotonic()
    with pytest.raises(NoRoomError, match="model b does not fit the memory budget"):
        asyncio.run(scenario())
    assert time.monotonic() - start < 5.0
    assert next(p for p in pool.snapshot() if p.name == "gemma3-270m").users == 0  # its pins let go


def test_one_place_decides_whether_a_served_ensemble_carries_its_hedge_weights_and_where():
    from segfuse.ensemble import Ensemble
    from segfuse.hedge_store import MemoryWeights
    from segfuse.server.app import create_app
    from segfuse.server.responses.store import ResponseStore
    from segfuse.server.shared import Shared, hedge_of

    one = build_config(hedge_persist=True)
    shared = Shared(ResponseStore())
    assert hedge_of(one, shared) == (True, shared.weights)  # the store the front ends share
    persist, store = hedge_of(one)
    assert persist and isinstance(store, MemoryWeights)
    assert hedge_of(build_config(), shared)[0] is False  # the operator's choice, off by default
    two = build_config(ensembles={"small": ["smollm2-135m"], "full": ["smollm2-135m", "gemma3-270m"]})
    assert hedge_of(two, shared)[0] is False  # one ensemble's weights (config.py refuses hedge_persist here)
    given = Ensemble.holding([], hedge_persist=True)
    assert hedge_of(build_config(), shared, given) == (True, given.hedge_store)  # the caller's ensemble: its own
    served = create_app(one, shared=shared).state.segfuse.pool.ensemble
    assert served.hedge_persist and served.hedge_store is shared.weights
    assert not create_app(build_config()).state.segfuse.pool.ensemble.hedge_persist
