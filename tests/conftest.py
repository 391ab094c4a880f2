"""Shared fixtures: the real embedded default models, loaded once per test session."""

from __future__ import annotations

import pytest

from specfuse import Ensemble
from specfuse import models as catalogue
from helpers import Recording


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


@pytest.fixture()
def recording(default_ensemble):
    return [Recording(m) for m in default_ensemble.members]
