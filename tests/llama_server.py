"""Start llama-cpp-python's OpenAI-compatible server on a free loopback port, for tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
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
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama_cpp.server did not start in 90 s")
            time.sleep(0.5)
        yield LlamaServer(url, proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
