"""Start a real `specfuse serve` in a subprocess on a free loopback port (used by the server tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from llama_server import free_port, wait_until_serving

API_KEY = "test-key"


@dataclass
class RunningServer:
    url: str
    api_key: str
    log: Path
    process: subprocess.Popen

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@contextmanager
def specfuse_server(tmp: Path, *, queue_size: int = 8, max_body_bytes: int = 65536, max_concurrent: int = 2,
                    startup_s: float = 180.0) -> Iterator[RunningServer]:
    """A server with the real default members, an API key, a small queue and body limit,
    running `max_concurrent` generations together."""
    port = free_port()
    config = tmp / "specfuse.toml"
    config.write_text(
        "[server]\n"
        f'api_key = "{API_KEY}"\n'
        f"queue_size = {queue_size}\n"
        f"max_concurrent = {max_concurrent}\n"
        f"max_body_bytes = {max_body_bytes}\n"
        # One llama.cpp thread per member: on a busy 2-core machine, threads that spin-wait for
        # each other made rounds 3-6x slower than a single thread (measured: 3.0 vs 10.9-18.7 s
        # per 4-token request while other jobs ran).
        "[members]\n"
        "threads = 1\n"
        "[defaults]\n"
        "max_tokens = 16\n"
    )
    log = tmp / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "SPECFUSE_API_KEY"}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "specfuse.cli", "serve", "--config", str(config), "--port", str(port)],
            stdout=sink, stderr=subprocess.STDOUT, env=env,
        )
    server = RunningServer(f"http://127.0.0.1:{port}", API_KEY, log, process)
    try:
        wait_until_serving(process, f"{server.url}/health", startup_s, server.log_tail)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # graceful: uvicorn's shutdown closes the members
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    """Poll until `predicate()` returns a truthy value; return it or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
