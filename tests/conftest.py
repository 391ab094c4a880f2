"""Shared fixtures: the real embedded default models, loaded once per test session."""

from __future__ import annotations

import pytest

from specfuse import Ensemble
from specfuse import models as catalogue


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


class Recording:
    """Wraps a real member and keeps the sessions it opens, for inspecting them after a run."""

    def __init__(self, member):
        self.member = member
        self.sessions = []

    @property
    def name(self):
        return self.member.name

    def start(self, messages, *, seed, reserve):
        session = self.member.start(messages, seed=seed, reserve=reserve)
        self.sessions.append(session)
        return session

    def close(self):
        pass


@pytest.fixture()
def recording(default_ensemble):
    return [Recording(m) for m in default_ensemble.members]
