"""Servers on loopback for benchmarks and tests: `segfuse serve` and `llama_cpp.server`.

Each runs in a subprocess on a free port, its output in a log file (not a pipe:
llama.cpp logs enough to fill a pipe and block), and is stopped on the way out
of its ``with`` block, also on Ctrl-C, SIGTERM or an error; on Linux a child
also gets SIGTERM if this process dies without cleaning up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import SegfuseError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_until_serving(
    process: subprocess.Popen[bytes],
    url: str,
    timeout: float,
    log: Path,
    ok: Callable[[Any], bool] = lambda r: r.status_code == 200,
) -> None:
    """Poll `url` until `ok(response)`; fail at once if `process` exits, or after `timeout` s."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise SegfuseError(
                f"the server exited with status {process.returncode} while starting:\n{tail(log)}", f"see {log}"
            )
        try:
            if ok(httpx.get(url, timeout=5)):
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SegfuseError(f"the server did not become ready in {timeout:.0f} s:\n{tail(log)}", f"see {log}")
        time.sleep(0.25)


def _parent_death_signal() -> Callable[[], None]:
    """A preexec_fn: the child acts on SIGINT (a process started in the background inherits it ignored, and
    the servers stop gracefully on it), and on Linux gets SIGTERM if this process dies without cleaning up
    (e.g. SIGKILL). libc is looked up here, in the parent: the child only calls it."""
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None

    def set_up() -> None:  # pragma: no cover - runs in the child between fork and exec
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return set_up


def stop(process: subprocess.Popen[bytes], first: int, grace: float, *, group: bool = False) -> None:
    """`first` (uvicorn's graceful shutdown), again after `grace` s (uvicorn then exits at once), then SIGKILL;
    with `group`, to the process group the process leads (a server's workers too)."""

    def send(signum: int) -> None:
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)

    for _ in range(2):
        if process.poll() is not None:
            break
        try:
            send(first)
            process.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
    else:
        try:
            send(signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    if group:  # workers the leader left behind
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def running(
    args: list[str],
    log: Path,
    first_signal: int,
    grace: float,
    env: Mapping[str, str] | None = None,
    *,
    group: bool = False,
) -> Iterator[subprocess.Popen[bytes]]:
    """`args` in a subprocess, its output in `log`, stopped when the block ends; with `group`, in a
    process group of its own, stopped with every process in it."""
    env = dict(env if env is not None else {k: v for k, v in os.environ.items() if k != "SEGFUSE_API_KEY"})
    with log.open("wb") as sink:
        process = subprocess.Popen(
            args,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=_parent_death_signal(),
            start_new_session=group,
        )
    try:
        yield process
    finally:
        stop(process, first_signal, grace, group=group)


def toml_text(sections: Mapping[str, Mapping[str, Any]]) -> str:
    """A TOML document of flat tables (strings, numbers, booleans, lists of them)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)  # a JSON string or number is valid TOML

    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


@dataclass
class SegfuseServer:
    url: str  # base URL, no /v1
    api_key: str
    log: Path
    process: subprocess.Popen[bytes]

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def health(self) -> dict[str, Any]:
        import httpx

        # With the key when there is one: /health may show the members' occupancy to key holders only.
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        health: dict[str, Any] = httpx.get(f"{self.url}/health", timeout=10, headers=headers).json()
        return health

    def log_tail(self, n: int = 40) -> str:
        return tail(self.log, n)


@contextmanager
def segfuse_server(
    workdir: Path,
    name: str,
    config: Mapping[str, Mapping[str, Any]],
    *,
    startup_s: float = 600,
    extra_args: tuple[str, ...] = (),
) -> Iterator[SegfuseServer]:
    """`python -m segfuse.cli serve` with `config` (TOML sections) on a free port, until the block ends.

    ``config["server"]["api_key"]`` is the key clients must send. A bad setting
    fails before a subprocess is started.
    """
    from ...config import build_config

    path = workdir / f"{name}.toml"
    path.write_text(toml_text(config))
    build_config(path)
    port = free_port()
    log = workdir / f"{name}.log"
    args = [
        sys.executable,
        "-m",
        "segfuse.cli",
        "serve",
        "--config",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    # SIGINT: uvicorn's graceful shutdown, which closes the members (a second SIGINT cuts open requests short).
    with running(args, log, signal.SIGINT, 20) as process:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(
            process,
            f"{url}/health",
            startup_s,
            log,
            ok=lambda r: r.status_code == 200 and r.json().get("status") == "ok",
        )
        yield SegfuseServer(url, str(config.get("server", {}).get("api_key") or ""), log, process)


@dataclass
class LlamaServer:
    url: str  # ends in /v1
    log: Path
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@contextmanager
def llama_cpp_server(
    gguf: Path,
    log: Path,
    *,
    threads: int | None = 1,
    n_ctx: int = 2048,
    startup_s: float = 180,
    port: int | None = None,
    extra_args: tuple[str, ...] = (),
) -> Iterator[LlamaServer]:
    """`python -m llama_cpp.server` for one GGUF on loopback (`port`, else a free one), until the block ends;
    `extra_args`: more of its settings (e.g. ``--cache true``).

    Started through ``llama_server.py``, which loads the model as our own llama.cpp members do."""
    port = port or free_port()
    args = [
        sys.executable,
        "-m",
        "segfuse.bench.common.llama_server",
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        # flash attention as in the local llama.cpp backend, so that both compute the same numbers
        # (without it log-probs differ by up to ~0.3 nats: f16 attention accumulates differently)
        "--flash_attn",
        "true",
    ]
    if threads is not None:
        args += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    args += list(extra_args)
    with running(args, log, signal.SIGTERM, 10) as process:
        url = f"http://127.0.0.1:{port}/v1"
        wait_until_serving(process, f"{url}/models", startup_s, log)
        yield LlamaServer(url, log, process)


class MemberServer:
    """A ``llama_cpp.server`` on a port of its own, which the soak kills and starts again."""

    def __init__(self, gguf: Path, workdir: Path, name: str, threads: int | None, n_ctx: int) -> None:
        self.gguf, self.workdir, self.name, self.threads, self.n_ctx = gguf, workdir, name, threads, n_ctx
        self.port = free_port()
        self.starts = 0
        self._stack: ExitStack | None = None
        self._process: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        stack = ExitStack()
        log = self.workdir / f"{self.name}-{self.starts}.log"
        self._process = stack.enter_context(
            llama_cpp_server(self.gguf, log, threads=self.threads, n_ctx=self.n_ctx, port=self.port)
        )
        self._stack, self.starts = stack, self.starts + 1

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self._process is not None:
            self._process.kill()
        self.stop()

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt (main thread only), so that the cleanup runs as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
