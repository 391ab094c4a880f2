"""Shared fixtures: the real embedded default models, loaded once per test session."""

from __future__ import annotations

import pytest

from helpers import Recording
from segfuse import Ensemble
from segfuse import models as catalogue


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
