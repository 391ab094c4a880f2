"""A real `segfuse serve` with several models: members loaded when a request names them, shared between
ensembles, freed when idle or when the budget wants the room, never while in use (the real openai client)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import API_KEY, wait_for
from segfuse.bench.common.processes import segfuse_server

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.models, pytest.mark.slow]

SMALL = ["smollm2-135m", "gemma3-270m"]
FULL = ["qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"]


@contextmanager
def server(tmp: Path, name: str, ensembles: dict | None = None, **settings):
    config = {
        "server": {"api_key": API_KEY, "max_concurrent": 2, "queue_size": 8, **settings},
        "members": {"threads": 1, "n_ctx": 1024},
        "defaults": {"max_tokens": 8},
    }
    for model, members in (ensembles or {"small": SMALL, "full": FULL}).items():
        config[f"ensembles.{model}"] = {"members": members}
    with segfuse_server(tmp, name, config, startup_s=300) as running:
        yield running


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.api, api_key=API_KEY, max_retries=0, timeout=300)


def memory(running) -> dict:
    return running.health()["memory"]


def rss_bytes(running) -> int:
    status = Path(f"/proc/{running.process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def ask(running, model: str, **extra) -> str:
    answer = client(running).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, extra_body=extra or None
    )
    return answer.model


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """One server for the tests below, in order: small (preloaded), full (one more member), broken."""
    tmp = tmp_path_factory.mktemp("on-demand")
    ensembles = {"small": SMALL, "full": FULL, "broken": ["smollm2-135m", f"{tmp / 'missing.gguf'}#lost"]}
    with server(tmp, "shared", ensembles) as serving:
        yield serving


class Reading(threading.Thread):
    """A streamed answer read in a thread of its own; `hang_up()` closes it early, as a client that has
    read enough would (the server cancels the rest)."""

    def __init__(self, read: Callable[[threading.Event], None]) -> None:
        self.enough = threading.Event()
        super().__init__(target=read, args=(self.enough,))

    def hang_up(self, timeout: float = 300) -> None:
        self.enough.set()
        self.join(timeout)


def stream(running, model: str, member: str, words: int, out: list[str], long: bool = False) -> Reading:
    """A streamed answer to `model`, read in a thread of its own into `out`, once `member` is in use (`long`:
    900 tokens, past any end of the answer, so that it is still in flight seconds later, until the test
    hangs up)."""

    def read(enough: threading.Event) -> None:
        chunks = client(running).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count from one to {words} in words."}],
            max_tokens=900 if long else 2 * words,
            stream=True,
            extra_body={"segfuse": {"ignore_eos": True}} if long else None,
        )
        with chunks:
            for chunk in chunks:
                out.extend(c.delta.content or "" for c in chunk.choices)
                if enough.is_set():
                    break

    reading = Reading(read)
    reading.start()
    wait_for(lambda: memory(running)[member]["in_use"] > 0, 60, 0.05, what="the stream to start")
    return reading


def test_two_ensembles_share_a_member_and_a_request_loads_what_its_model_lacks_while_another_streams(running):
    # The default model (the first ensemble) is loaded at start; the other one's own member is not.
    held = memory(running)
    assert {n: held[n]["state"] for n in held} == {
        "smollm2-135m": "loaded",
        "gemma3-270m": "loaded",
        "qwen2.5-coder-0.5b": "unloaded",
        "lost": "unloaded",
    }
    assert held["smollm2-135m"]["ensembles"] == ["small", "full", "broken"]
    cards = {c.id: c for c in client(running).models.list().data}
    assert cards["small"].model_extra["loaded"] and not cards["full"].model_extra["loaded"]
    assert cards["full"].model_extra["members"] == FULL
    assert cards["qwen2.5-coder-0.5b"].model_extra["ensembles"] == ["full"]

    streamed: list[str] = []
    streaming = stream(running, "small", "smollm2-135m", 12, streamed, long=True)
    assert ask(running, "full") == "full"  # loads qwen while small streams
    assert streaming.is_alive(), "the stream ended before full's answer: nothing was loaded beside it"
    streaming.hang_up()
    assert not streaming.is_alive() and "".join(streamed).strip()
    held = memory(running)
    assert all(held[n]["state"] == "loaded" and held[n]["loads"] == 1 for n in FULL), held
    assert held["qwen2.5-coder-0.5b"]["bytes"] > 100_000_000
    assert running.health()["counters"]["failed"] == 0


def test_keep_alive_zero_frees_the_members_nothing_else_uses_right_after_the_answer(running):
    wait_for(lambda: memory(running)["qwen2.5-coder-0.5b"]["in_use"] == 0, 30, what="the answer to let go")
    loaded_rss = rss_bytes(running)
    assert memory(running)["qwen2.5-coder-0.5b"]["state"] == "loaded"  # a member of no preloaded model: 5m
    assert memory(running)["qwen2.5-coder-0.5b"]["expires_in_s"] > 200
    ask(running, "qwen2.5-coder-0.5b", keep_alive=0)
    wait_for(lambda: memory(running)["qwen2.5-coder-0.5b"]["state"] == "unloaded", 30, what="qwen to be freed")
    freed = loaded_rss - rss_bytes(running)
    assert freed > 100_000_000, f"RSS fell by {freed} bytes only"
    # The small ensemble's members were not asked to go: they stay.
    assert all(memory(running)[n]["state"] == "loaded" for n in SMALL)
    ask(running, "full")  # and a later request loads it again
    assert memory(running)["qwen2.5-coder-0.5b"]["loads"] == 2


def test_a_budget_of_two_members_serves_three_in_turn_and_never_frees_one_in_use(tmp_path):
    ensembles = {"small": SMALL, "coder": ["qwen2.5-coder-0.5b"]}
    with server(tmp_path, "budget", ensembles, max_loaded_members=2, preload=[], keep_alive="-1") as running:
        assert all(m["state"] == "unloaded" for m in memory(running).values())
        for model in FULL:
            assert ask(running, model) == model
            held = memory(running)
            assert held[model]["state"] == "loaded"
            assert sum(m["state"] == "loaded" for m in held.values()) <= 2
        # smollm2 streams (in use), then gemma3 answers: smollm2 is the least recently used, but in use, so
        # qwen's load must free gemma3.
        streamed: list[str] = []
        streaming = stream(running, "smollm2-135m", "smollm2-135m", 16, streamed, long=True)
        ask(running, "gemma3-270m")
        assert memory(running)["smollm2-135m"]["in_use"] > 0, "the long stream ended before qwen was asked for"
        assert ask(running, "qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b"
        streaming.hang_up()
        assert "".join(streamed).strip()
        held = memory(running)
        assert held["smollm2-135m"]["loads"] == 1 and held["gemma3-270m"]["state"] == "unloaded", held
        assert running.health()["counters"]["failed"] == 0


def test_an_unknown_model_and_a_bad_keep_alive_get_clear_errors(running):
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    unknown = httpx.post(f"{running.api}/chat/completions", json={**body, "model": "large"}, headers=headers)
    assert unknown.status_code == 404 and "small, full, broken" in unknown.json()["error"]["message"]
    bad = httpx.post(
        f"{running.api}/chat/completions", json={**body, "model": "small", "keep_alive": "soon"}, headers=headers
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


def test_a_member_whose_file_is_missing_fails_its_model_with_a_clear_error_and_the_others_go_on(running):
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    failed = httpx.post(f"{running.api}/chat/completions", json={**body, "model": "broken"}, headers=headers)
    assert failed.status_code == 503, failed.text
    error = failed.json()["error"]
    assert error["code"] == "model_load_failed" and "lost" in error["message"] and "not found" in error["message"]
    assert memory(running)["lost"]["state"] == "failed" and "not found" in memory(running)["lost"]["error"]
    assert memory(running)["smollm2-135m"]["in_use"] == 0  # the failed load let its pins go
    assert ask(running, "small") == "small"
    assert running.health()["counters"]["failed"] == 0
