"""A model loaded or freed because someone asked, without a generation: our API's
``POST /v1/models/{name}/load`` and ``/unload``, and any other API's way of saying the same (Ollama's empty
generate, its ``keep_alive: 0``). Both go through the pool, so the memory budget, pins and leases hold as
for a request: a member in use is never freed mid-answer.
"""

from __future__ import annotations

import asyncio
import time

from .catalog import Model
from .fit import ModelInUseError
from .pool import Pool


async def load_model(pool: Pool, model: Model, keep_s: float | None = None, deadline_s: float | None = None) -> None:
    """Load `model`'s members now; then they stay their keep-alive from now (`keep_s` as a request's; None:
    the model's, else the server's). Raises what a request's lease raises (TooLargeError, NoRoomError,
    LoadFailedError, QueueFullError); `deadline_s`: how long it may wait for room (None: no deadline)."""
    async with pool.lease(model, keep_s, deadline_s):
        pass


async def unload_model(pool: Pool, model: Model, wait_s: float = 0.0) -> None:
    """Free `model`'s members now: pinned ones too (someone asked), and members other models share (they load
    them again when asked). A member in use goes once let go, within `wait_s` seconds; else ModelInUseError
    names it (what was idle is freed either way). A member the serving program gave loaded is never freed."""
    names = list(dict.fromkeys(model.members))
    given = [n for n in names if not pool.places[n].owned and pool.places[n].member is not None]
    if given:
        raise ModelInUseError(
            f"member {given[0]} of model {model.name} was given loaded by the program that serves it, and is never "
            "freed here"
        )
    deadline = time.monotonic() + wait_s
    while True:
        closing = [pool.free(pool.places[n], f"model {model.name} asked to unload") for n in names]
        await asyncio.gather(*(asyncio.wrap_future(f) for f in closing if f is not None))
        if await pool.changes.until(lambda: _gone(pool, names) or _idle(pool, names), deadline):
            if _gone(pool, names):
                return
            continue  # one was let go: free it too
        busy = ", ".join(f"{p.name} ({p.users} holding it)" for p in pool.snapshot() if p.name in names and p.users)
        raise ModelInUseError(
            f"model {model.name} is answering: {busy or 'a member is loading'}; what is in use was not freed",
            "retry when its answers are done, or wait longer for them (?wait=SECONDS)",
        )


def _gone(pool: Pool, names: list[str]) -> bool:
    return all(pool.places[n].state in ("unloaded", "failed") for n in names)


def _idle(pool: Pool, names: list[str]) -> bool:
    return any(pool.places[n].state == "loaded" and not pool.places[n].users for n in names)


__all__ = ["load_model", "unload_model"]
