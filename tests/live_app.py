"""The app over the session's embedded members, served by uvicorn in a thread (as `segfuse serve` serves
it), for the tests of the Messages and Responses APIs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jsonschema
import uvicorn

from helpers import wait_for
from segfuse.config import ServerConfig
from segfuse.server.app import create_app, uvicorn_settings
from segfuse.server.state import ServerState

KEY = "apis-key"
LEADER = "smollm2-135m"  # the quickest member, alone, where the test is not about fusion
WEATHER = {  # a tool as the Messages API offers it
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def weather_call(anthropic_client: Any, messages: list[dict[str, Any]]) -> Any:
    """The leader's Messages answer to `messages` with a tool call forced: a call of the weather tool whose
    input validates against the tool's schema (checked here)."""
    message = anthropic_client.messages.create(
        model=LEADER, max_tokens=48, tools=[WEATHER], tool_choice={"type": "any"}, messages=messages
    )
    assert message.stop_reason == "tool_use", message
    call = message.content[0]
    assert call.type == "tool_use" and call.name == "get_weather", call
    jsonschema.validate(call.input, WEATHER["input_schema"])
    return message


@dataclass
class Live:
    url: str
    state: ServerState

    @property
    def api(self) -> str:
        return f"{self.url}/v1"


@contextmanager
def live(ensemble: Any, *, limits: dict[str, Any] | None = None, **server: Any) -> Iterator[Live]:
    config = ServerConfig.model_validate(
        {
            "server": {
                "api_key": KEY,
                "port": 0,
                "queue_size": 4,
                "max_concurrent": 2,
                "log_level": "warning",
                **server,
            },
            "limits": {"max_tokens": 64, "max_stops": 4, "max_messages": 40, "max_tools": 4, **(limits or {})},
            "defaults": {"max_tokens": 8, "temperature": 0},
        }
    )
    with serve_app(config, ensemble) as (url, state):
        yield Live(url, state)


@contextmanager
def live_unfailing(ensemble: Any, **server: Any) -> Iterator[Live]:
    """`live`, and at its end the worker failed no generation (a module's server fixture)."""
    with live(ensemble, **server) as running:
        yield running
        assert running.state.worker.queue.snapshot()["failed"] == 0


@contextmanager
def serve_app(config: ServerConfig, ensemble: Any) -> Iterator[tuple[str, ServerState]]:
    """The app over `ensemble` under `config`, served by uvicorn in a thread: its URL and its state."""
    app = create_app(config, ensemble)
    runner = uvicorn.Server(uvicorn.Config(app, **uvicorn_settings(config)))
    thread = threading.Thread(target=runner.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        wait_for(lambda: runner.started or not thread.is_alive(), 60, what="uvicorn to start")
        assert runner.started, "uvicorn did not start"
        port = runner.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", app.state.segfuse
    finally:
        runner.should_exit = True
        thread.join(60)


def idle(state: ServerState) -> bool:
    """No request waiting or running, and every member's slots free again."""
    worker = state.worker
    return worker.queue.state() == (0, 0) and all(
        o.free_slots in (None, o.slots) for o in worker.queue.occupancy().values()
    )
