"""Shared fixtures: the real embedded default models, loaded once per test session (per worker when
`make test` runs the suite on two workers); and how the files are shared between those workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import Recording
from segfuse import Ensemble
from segfuse import models as catalogue

# One llama.cpp thread per member, here and in every child process (servers, CLI runs): two workers then
# share the two cores, and no member's threads spin-wait for a core another process holds (two threads
# on a busy 2-core machine made rounds 3-9x slower). The answers are the same code's; only the pace differs.
os.environ.setdefault("SEGFUSE_THREADS", "1")

# The modules that start a Ray cluster or instance (nodes on 127.0.0.2 and .3): one at a time, on one worker.
RAY_MODULES = frozenset({"test_ray.py", "test_ray_serve.py", "test_deterministic_fusion.py"})


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist: each file whole on one worker (its module fixtures, servers among them, start
    once), and the Ray files together on one worker, so that two clusters never run at once."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "the Ray modules" if Path(path).name in RAY_MODULES else path

    return ByFile(config, log)


def _require_prepared() -> None:
    missing = [n for n in catalogue.DEFAULT_MODELS if not catalogue.is_ready(catalogue.CATALOGUE[n])]
    if missing:
        pytest.fail(f"models not prepared: {missing}; run `make models` (make test does it)", pytrace=False)


@pytest.fixture(scope="session")
def default_ensemble():
    """The three embedded members, loaded once for every test that needs them."""
    _require_prepared()
    ensemble = Ensemble()
    yield ensemble
    ensemble.close()


@pytest.fixture(scope="session")
def uncached_ensemble():
    """The three embedded members with no prefix cache, for tests that compare two greedy answers to one
    prompt: each reads its prompt afresh in the same cache layout, so they agree to the last bit. (Cells
    reused from a prefix cache, or other entries it holds, change the kernels' arithmetic in the last bits,
    which can flip a near-tie.)"""
    _require_prepared()
    ensemble = Ensemble(prefix_cache_cells=0)
    yield ensemble
    ensemble.close()


@pytest.fixture(scope="module")
def uncached_server(uncached_ensemble):
    """The app over `uncached_ensemble` on loopback, for one module; at its end the worker failed no
    generation. (No prefix cache: a streamed and a whole greedy answer agree to the bit.)"""
    from live_app import live_unfailing

    with live_unfailing(uncached_ensemble) as running:
        yield running


@pytest.fixture(scope="module")
def openai_client(server):
    """OpenAI's client of the module's in-process `server` (live_app's)."""
    import openai

    from live_app import KEY

    return openai.OpenAI(base_url=server.api, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def anthropic_client(server):
    """Anthropic's client of the module's in-process `server` (live_app's)."""
    import anthropic

    from live_app import KEY

    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    """An HTTP client of the module's `server`, with its API key."""
    import httpx

    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=300
    ) as session:
        yield session


@pytest.fixture()
def recording(default_ensemble):
    return [Recording(m) for m in default_ensemble.members]
