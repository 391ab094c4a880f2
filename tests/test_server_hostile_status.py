"""Hostile findings on what a server says of itself and of a request's keep_alive, on in-process apps over one
small real member (smollm2) with a model whose member's file is missing: a keep_alive too large for a float
is a 400 naming it on every API; /health's per-member error loses its path without the key; /metrics names
no member to a scrape without the key of a server that has one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers import wait_for
from live_app import serve_app
from segfuse import Ensemble
from segfuse.config import ServerConfig

pytestmark = [pytest.mark.models]

KEY = "status-key"
MEMBER = "smollm2-135m"
MISSING = "/srv/private/weights/missing-model.gguf"  # a path no client should read back
HUGE = "1" + "0" * 400  # a JSON integer no float can hold


@pytest.fixture(scope="module")
def ensemble() -> Iterator[Ensemble]:
    members = Ensemble([MEMBER], slots=2, threads=1, n_ctx=512)
    yield members
    members.close()


def config(api_key: str | None) -> ServerConfig:
    return ServerConfig.model_validate(
        {
            "server": {"api_key": api_key, "port": 0, "queue_size": 4, "max_concurrent": 2, "log_level": "warning"},
            "members": {"models": [MEMBER], "threads": 1, "n_ctx": 512},
            "defaults": {"max_tokens": 2, "temperature": 0},
            "ensembles": {"broken": {"members": [MEMBER, f"{MISSING}#lost"]}},
        }
    )


@pytest.fixture(scope="module")
def keyed(ensemble) -> Iterator[str]:
    with serve_app(config(KEY), ensemble) as (url, _):
        yield url


@pytest.fixture(scope="module")
def open_server(ensemble) -> Iterator[str]:
    with serve_app(config(None), ensemble) as (url, _):
        yield url


def fail_broken(url: str, headers: dict[str, str]) -> None:
    """Ask the model whose member cannot load, once: its member is `failed` from then on."""
    body = {"model": "broken", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_load_failed", answer.text


# --------------------------------------------------------------------------- finding 1: keep_alive


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/v1/messages": {"model": MEMBER, **CHAT},
    "/v1/messages/count_tokens": {"model": MEMBER, "messages": CHAT["messages"]},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 16},
}


@pytest.mark.parametrize(
    "value", [HUGE, str(-(10**22)), "1e400", "-1e400"], ids=["1e400-int", "-1e22", "1e400", "-1e400"]
)
@pytest.mark.parametrize("path", list(BODIES))
def test_a_keep_alive_too_large_for_a_float_is_a_400_naming_it(keyed, path, value):
    text = json.dumps(BODIES[path])[:-1] + f', "keep_alive": {value}}}'  # the number as written, not as a float
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    answer = httpx.post(f"{keyed}{path}", content=text, headers=headers, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "keep_alive" in error["message"], error
    if not path.startswith("/v1/messages"):  # Anthropic's error shape has no param
        assert error["param"] == "keep_alive", error


# --------------------------------------------------------------------------- finding 4: /health's member errors


def test_health_member_errors_lose_their_paths_on_a_server_without_a_key(open_server):
    fail_broken(open_server, {})
    memory = httpx.get(f"{open_server}/health", timeout=30).json()["memory"]
    error = memory["lost"]["error"]
    assert memory["lost"]["state"] == "failed" and "not found" in error, memory["lost"]
    assert "/srv/private" not in error and "<path>" in error, error


# --------------------------------------------------------------------------- finding 3: /metrics


def test_metrics_name_no_member_without_the_key_of_a_server_that_has_one(keyed):
    headers = {"Authorization": f"Bearer {KEY}"}
    fail_broken(keyed, headers)
    wait_for(lambda: httpx.get(f"{keyed}/health", headers=headers).json()["memory"]["lost"]["state"] == "failed", 30)
    public = httpx.get(f"{keyed}/metrics", timeout=30)
    assert public.status_code == 200
    assert "segfuse_requests_total" in public.text and "segfuse_queue_depth" in public.text  # aggregates stay
    for name in (MEMBER, "lost", "member="):
        assert name not in public.text, [line for line in public.text.splitlines() if name in line][:5]
    private = httpx.get(f"{keyed}/metrics", headers=headers, timeout=30).text
    assert f'member="{MEMBER}"' in private and 'member="lost"' in private


def test_metrics_show_every_member_on_a_server_without_a_key(open_server):
    assert f'member="{MEMBER}"' in httpx.get(f"{open_server}/metrics", timeout=30).text
