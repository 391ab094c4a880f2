"""The memory budget in bytes before a member loads: sizes estimated from files count until the real ones
are known, a model that can never fit is refused with what it needs and what to do, pinned ensembles stay,
and a model loads or unloads without a generation (the pool alone, fake members: no model is loaded)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from segfuse.config import ConfigError, ServerConfig, build_config
from segfuse.keep_alive import FOREVER

pytest.importorskip("fastapi")
from segfuse.server.models import changes as changes_module
from segfuse.server.models.catalog import Catalog
from segfuse.server.models.fit import ModelInUseError, TooLargeError, check_all, sizes_of
from segfuse.server.models.on_request import load_model, unload_model
from segfuse.server.models.pool import Budget, NoRoomError, Place, Pool
from segfuse.server.models.view import model_state
from segfuse.server.serving import api_error
from segfuse.server.worker.thread import Worker

MiB = 2**20
REAL = {"smollm2-135m": 300 * MiB, "gemma3-270m": 850 * MiB, "qwen2.5-coder-0.5b": 850 * MiB}
ESTIMATED = {name: int(size * 1.1) for name, size in REAL.items()}  # the estimates err high, as they do
ENSEMBLES = {"small": ["smollm2-135m", "gemma3-270m"], "coder": ["smollm2-135m", "qwen2.5-coder-0.5b"]}


class Sized:
    """A fake member of REAL's bytes; each load checks that what is loaded then stays within the bound."""

    loaded: ClassVar[list[Sized]] = []
    worst = 0

    def __init__(self, spec: str) -> None:
        self.name, self.nbytes = spec, REAL[spec]
        Sized.loaded.append(self)
        Sized.worst = max(Sized.worst, sum(m.nbytes for m in Sized.loaded))

    def close(self) -> None:
        Sized.loaded.remove(self)


def pool_of(bound: int, ensembles: dict | None = None, **server) -> tuple[Catalog, Pool]:
    catalog = Catalog.of(build_config(ensembles=ensembles or ENSEMBLES, preload=[], **server))
    Sized.loaded, Sized.worst = [], 0
    pool = Pool(catalog, Worker(4), Sized, Budget(nbytes=bound), keep_alive_s=60.0)
    for place in pool.places.values():
        place.estimate = ESTIMATED[place.name]
    return catalog, pool


def test_a_member_not_loaded_yet_counts_its_estimate_then_its_real_size():
    places = [Place("a", "a", state="loaded", nbytes=600), Place("b", "b", state="loading", estimate=300)]
    coming = Place("c", "c", estimate=200)
    assert Budget(nbytes=1000).over(places, [coming])  # 600 + 300 + 200: the first load may not pass the bound
    assert not Budget(nbytes=1100).over(places, [coming])
    places[1].nbytes = 100  # loaded: its real size replaces the estimate
    assert not Budget(nbytes=1000).over(places, [coming])


def test_first_loads_never_take_the_budget_past_its_bound(monkeypatch):
    monkeypatch.setattr(changes_module, "WAKE_S", 0.05)
    bound = ESTIMATED["smollm2-135m"] + ESTIMATED["gemma3-270m"] + 10 * MiB  # two of the three members
    catalog, pool = pool_of(bound)

    async def alternate() -> None:
        for name in ["small", "coder", "small", "coder", "qwen2.5-coder-0.5b", "gemma3-270m"]:
            async with pool.lease(catalog.model(name), None, 5.0):
                pass

    asyncio.run(alternate())
    assert 0 < Sized.worst <= bound
    held = [p for p in pool.snapshot() if p.state == "loaded"]
    # The last request's gemma3 could not fit beside qwen (both large): both idle ones went, LRU first.
    assert sum(p.nbytes or 0 for p in held) <= bound and {p.name for p in held} == {"gemma3-270m"}


def test_a_model_that_can_never_fit_is_refused_at_start_and_at_its_request_naming_what_it_needs():
    catalog, pool = pool_of(900 * MiB)
    with pytest.raises(TooLargeError) as refused:
        check_all(catalog, sizes_of(pool.places.values()), pool.budget.nbytes)
    error = refused.value
    assert "member gemma3-270m of model small needs 935 MiB (estimated)" in error.message
    assert "more than max_loaded_bytes 900 MiB" in error.message and "raise [server] max_loaded_bytes" in error.hint
    # At its request (a server that started anyway: the member's size was not known then).
    assert asyncio.run(load_model(pool, catalog.model("smollm2-135m"))) is None
    with pytest.raises(TooLargeError, match="member gemma3-270m of model gemma3-270m needs 935 MiB"):
        asyncio.run(load_model(pool, catalog.model("gemma3-270m")))
    # Each member fits alone; an ensemble's members together do not.
    catalog, pool = pool_of(1000 * MiB)
    with pytest.raises(TooLargeError, match=r"model coder needs 1,265 MiB for its members together \(smollm2-135m"):
        asyncio.run(load_model(pool, catalog.model("coder")))
    assert all(p.users == 0 and p.state == "unloaded" for p in pool.snapshot())  # nothing pinned nor loaded for it
    answer = api_error(TooLargeError("x", "y"))
    assert (answer.status, answer.detail.code, answer.detail.param) == (400, "model_too_large", "model")


def test_a_pinned_ensemble_is_never_freed_by_expiry_nor_to_make_room_and_a_request_cannot_unpin_it():
    config = {"small": {"members": ENSEMBLES["small"], "keep_alive": -1}, "coder": {"members": ["qwen2.5-coder-0.5b"]}}
    with pytest.raises(ConfigError, match=r"ensembles.x.keep_alive: .*'soon' is not a duration"):
        _config_with({"x": {"members": ["a"], "keep_alive": "soon"}})
    catalog = Catalog.of(_config_with(config))
    assert catalog.pinned("gemma3-270m") and not catalog.pinned("qwen2.5-coder-0.5b")
    Sized.loaded = []
    pool = Pool(catalog, Worker(4), Sized, Budget(nbytes=1300 * MiB), keep_alive_s=0.0)
    for place in pool.places.values():
        place.estimate = ESTIMATED[place.name]

    async def scenario() -> None:
        async with pool.lease(catalog.model("small"), 0.0, None):  # a request's keep_alive 0: pinned wins
            pass
        async with pool.lease(catalog.model("coder"), None, None):  # the room is pinned: no wait would find it
            pass

    with pytest.raises(NoRoomError, match=r"beside smollm2-135m, gemma3-270m, which stay loaded \(pinned\)"):
        asyncio.run(scenario())
    places = {p.name: p for p in pool.snapshot()}
    assert places["gemma3-270m"].state == "loaded" and places["gemma3-270m"].expires_at() is None
    assert places["gemma3-270m"].keep_s == FOREVER and places["gemma3-270m"].pinned
    # Asked to, it goes (an operator's call), and the other model then has its room.
    asyncio.run(unload_model(pool, catalog.model("small")))
    assert {p.name: p.state for p in pool.snapshot()}["gemma3-270m"] == "unloaded"
    asyncio.run(load_model(pool, catalog.model("coder")))


def test_an_ensembles_keep_alive_is_its_members_unless_a_request_says_otherwise():
    catalog = Catalog.of(_config_with({"small": {"members": ENSEMBLES["small"], "keep_alive": "10m"}}))
    assert catalog.keep_of("gemma3-270m") == 600.0 and catalog.keep_of("nothing") is None
    pool = Pool(catalog, Worker(4), Sized, Budget(), keep_alive_s=60.0)
    asyncio.run(load_model(pool, catalog.model("small")))
    assert {p.keep_s for p in pool.snapshot()} == {600.0}
    asyncio.run(load_model(pool, catalog.model("small"), keep_s=5.0))
    assert {p.keep_s for p in pool.snapshot()} == {5.0}


def test_unloading_a_model_in_use_waits_for_its_answer_or_is_refused_and_frees_nothing_in_use():
    catalog, pool = pool_of(4000 * MiB)
    small = catalog.model("small")

    async def scenario() -> tuple[str, str]:
        await load_model(pool, small)
        assert model_state(pool, small).state == "idle"
        async with pool.lease(small, None, None) as lease:
            let_go = lease.hold()  # a job: it holds the members past the request
        with pytest.raises(ModelInUseError, match=r"model small is answering: smollm2-135m \(1 holding it\)"):
            await unload_model(pool, small, wait_s=0.2)
        refused = model_state(pool, small).state
        threading.Timer(0.2, let_go).start()
        await unload_model(pool, small, wait_s=5.0)
        return refused, model_state(pool, small).state

    assert asyncio.run(scenario()) == ("loaded", "unloaded")
    assert Sized.loaded == []
    answer = api_error(ModelInUseError("x"))
    assert (answer.status, answer.detail.code) == (409, "model_in_use")


def _config_with(ensembles: dict) -> ServerConfig:
    """A config of `ensembles` tables as the file writes them (build_config validates and reports as `serve`)."""
    lines = ["[server]", "preload = []"]
    for name, table in ensembles.items():
        lines += [f"[ensembles.{name}]", *(f"{key} = {json.dumps(value)}" for key, value in table.items())]
    path = Path(tempfile.mkdtemp()) / "segfuse.toml"
    path.write_text("\n".join(lines), encoding="utf-8")
    return build_config(path)
