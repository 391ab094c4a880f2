"""Long-lived threads on which members compute: one per device (docs/design.md#where-members-compute).

A numerical library keeps state per thread that it builds on first use and that only that thread reuses:

- llama.cpp's CPU backend runs each decode as an OpenMP parallel region, and libgomp keeps a team of
  compute threads for every thread that ever started one; once the teams outnumber the cores, every
  decode slows down (its barriers sleep instead of spinning);
- torch's intra-op thread count (``torch.set_num_threads``) reaches OpenMP only on the thread that set it;
  on a CUDA device, cuBLAS handles and workspaces and cuDNN's attention plans are cached per thread,
  and a plan is built for every new shape (each new sequence length of a decode) in a thread that has
  not seen it.

A member whose work started on a new thread for every generation paid those costs again and again. So a
member hands its compute to the one thread of its device, whatever thread calls it; a handoff costs tens
of microseconds against milliseconds a token.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")


class ComputeThread:
    """One long-lived thread that runs what it is handed, one call at a time.

    `setup` runs first on the thread (settings a library keeps per thread). A call made on the thread itself
    runs at once, so a computation that calls another of the same thread does not wait for itself."""

    def __init__(self, name: str, setup: Callable[[], None] | None = None) -> None:
        self.name = name
        self._setup = setup
        self._pool: ThreadPoolExecutor | None = None
        self._ident: int | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # a forked child has no such thread: it starts its own
            os.register_at_fork(after_in_child=self._forget)

    @property
    def ident(self) -> int | None:
        """The thread's identity, once it has started."""
        return self._ident

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the thread (at once when called there): its value or its exception."""
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        future = self._executor().submit(fn, *args, **kwargs)
        try:
            return future.result()
        except KeyboardInterrupt:  # the computation ends before the caller unwinds (and frees what it reads)
            wait([future])
            raise

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
                self._ident = self._pool.submit(self._start).result()
            return self._pool

    def _start(self) -> int:
        if self._setup is not None:
            self._setup()
        return threading.get_ident()

    def _forget(self) -> None:
        self._pool, self._ident, self._lock = None, None, threading.Lock()


def compute_here(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the calling thread: where members that run side by side compute."""
    return fn(*args, **kwargs)


Compute = Callable[..., Any]  # ComputeThread.run, or compute_here

_BY_DEVICE: dict[str, ComputeThread] = {}
_BY_DEVICE_LOCK = threading.Lock()


def device_thread(device: str, setup: Callable[[], None] | None = None) -> ComputeThread:
    """The compute thread of `device` (``cpu``, ``cuda:0``, ...), made on first use with `setup`."""
    with _BY_DEVICE_LOCK:
        thread = _BY_DEVICE.get(device)
        if thread is None:
            thread = _BY_DEVICE[device] = ComputeThread(f"segfuse-{device.replace(':', '')}", setup)
        return thread


def on_compute(method: Callable[P, T]) -> Callable[P, T]:
    """A method that runs on its object's compute thread (``self.compute``, a :data:`Compute`)."""

    @functools.wraps(method)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        compute: Compute = args[0].compute  # type: ignore[attr-defined]  # args[0] is self: P cannot say so
        return compute(method, *args, **kwargs)  # type: ignore[no-any-return]  # Compute returns what fn does

    return run
