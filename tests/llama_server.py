"""Start llama-cpp-python's OpenAI-compatible server on a free loopback port, for tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class LlamaServer:
    url: str  # ends in /v1
    proc: subprocess.Popen

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(process: subprocess.Popen, url: str, timeout: float, log_tail: Callable[[], str],
                       interval: float = 0.25) -> None:
    """Poll `url` until it answers 200; fail at once if `process` exits, or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log_tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not become ready in {timeout} s:\n{log_tail()}")
        time.sleep(interval)


@contextmanager
def llama_server(gguf: Path, log: Path) -> Iterator[LlamaServer]:
    """Run `python -m llama_cpp.server` for `gguf` until the block ends."""
    port = free_port()
    with log.open("w") as sink:  # a file, not a pipe: llama.cpp logs enough to fill a pipe and block
        proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
             "--port", str(port), "--n_ctx", "2048", "--n_threads", "1", "--n_threads_batch", "1",
             # flash attention as in the local llama.cpp backend, so that both compute the same numbers
             # (without it log-probs differ by up to ~0.3 nats: f16 attention accumulates differently)
             "--flash_attn", "true"],
            stdout=sink, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until_serving(proc, f"{url}/models", 90, lambda: log.read_text()[-2000:])
        yield LlamaServer(url, proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
