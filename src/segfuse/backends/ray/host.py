"""One copy of a member in a Ray actor: it loads the member and runs every protocol call for its callers.

The actor is asynchronous: its methods only queue work for the member's one thread
(``loop.py``, which batches calls that arrive together) and wait for it, so callers in any
number of processes can call at once. Sessions live here, by id; every reply is a
:class:`~segfuse.backends.ray.wire.Done` whose values are the member's own (an exception a call
raised is a value too, so that it keeps its type), with the copy's load after it.

A draft streams: :meth:`MemberHost.draft` is a generator (call it with
``num_returns="streaming"``) that yields ``(item, text so far)`` as the member samples each token
of a draft asked to stream, then the Done. The member's thread never waits for a caller: a text
goes to the actor's event loop and on from there, so a caller that went away (cancelled, or its
process died) leaves nothing stuck; the draft ends, its tokens wait for an accept that may never
come, and the session expires.

Create copies with :func:`create_hosts` (placement: ``settings.py``); ``member.py`` is the caller's side.
"""

from __future__ import annotations

import asyncio
import functools
import os
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray

from ...member_options import MemberOptions
from ...types import Message
from ..base import Member
from ..registry import load_member
from .loop import CopyJob, MemberLoop, SessionBook
from .settings import RaySettings, placement
from .wire import Done, Held, HostInfo, Opened, portable

SESSION_METHODS = frozenset({"accept", "constrain", "text_logprob", "counters", "close"})
MEMBER_METHODS = frozenset({"prompt_tokens", "tokenize_text", "lead_tokens", "detokenize", "echo"})


class MemberHost:
    """A member loaded in this actor, and its sessions (module docstring)."""

    def __init__(self, spec: str, options: dict[str, Any], expire_s: float, gather_ms: float) -> None:
        self.incarnation = uuid.uuid4().hex
        self.error: Exception | None = None
        try:
            self.member: Member = load_member(spec, MemberOptions.build(options, where=f"member {spec!r}"))
        except Exception as exc:  # said to the caller by info(), with its own type
            self.error = portable(exc)
            return
        if hasattr(self.member, "slot_wait_s"):
            # A full copy refuses a session at once: its one thread must not wait for a slot that only a
            # close queued behind it could free. The caller tries another copy, or waits and retries.
            self.member.slot_wait_s = 0.0
        self.book = SessionBook(self.incarnation)
        self.loop = MemberLoop(self.member, self.book, expire_s=expire_s, gather_s=gather_ms / 1000)
        context = ray.get_runtime_context()
        m = self.member
        address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # Ray leaves it untyped
        self.about = HostInfo(
            m.name,
            m.capabilities,
            m.slots,
            m.n_params,
            m.placement,
            context.get_node_id(),
            address,
            os.getpid(),
            self.incarnation,
        )

    async def info(self) -> HostInfo | Exception:
        """Where this copy runs and what it loaded; the load error instead where loading failed."""
        return self.error if self.error is not None else self.about

    async def start(self, messages: Sequence[Message], kwargs: dict[str, Any]) -> Done:
        def work(member: Member, book: SessionBook) -> Done:
            session = member.start(messages, **kwargs)
            sid = book.add(session)
            opened = Opened(sid, tuple(session.stops), session.room, session.streams_text, len(book))
            return Done([opened], len(book), [session.room])

        return await self._run(CopyJob("call", work=work))

    async def session(self, sid: str, method: str, args: tuple[Any, ...]) -> Done:
        """``session.<method>(*args)`` for one of :data:`SESSION_METHODS`; ``close`` of a session this copy
        no longer holds is done already."""
        if method not in SESSION_METHODS:
            return Done([ValueError(f"no session method {method!r}")], len(self.book), [None])

        def work(member: Member, book: SessionBook) -> Done:
            if method == "close":
                session = book.pop(sid)
                if session is not None:
                    session.close()
                return Done([None], len(book), [None])
            session = book.get(sid)
            value = getattr(session, method)(*args)
            return Done([value], len(book), [session.room])

        return await self._run(CopyJob("call", work=work, sids=frozenset({sid})))

    async def draft(self, items: Sequence[tuple[str, int, Any, bool]]) -> AsyncIterator[tuple[int, str] | Done]:
        """Drafts of items ``(sid, max_tokens, sampling, streams)``: ``(item, text so far)`` while those that
        stream sample, then the Done (module docstring)."""
        events: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_text(index: int, text: str) -> None:  # on the member's thread: hand over, never wait
            loop.call_soon_threadsafe(events.put_nowait, (index, text))

        future = self.loop.submit(CopyJob("draft", items, on_text=on_text))
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
        while (event := await events.get()) is not None:
            yield event
        yield future.result()

    async def score(self, items: Sequence[tuple[str, Sequence[str]]]) -> Done:
        return await self._run(CopyJob("score", items))

    async def call(self, method: str, args: tuple[Any, ...]) -> Done:
        """``member.<method>(*args)`` for one of :data:`MEMBER_METHODS`."""
        if method not in MEMBER_METHODS:
            return Done([ValueError(f"no member method {method!r}")], len(self.book), [None])
        return await self._run(
            CopyJob("call", work=lambda member, book: Done([getattr(member, method)(*args)], len(book), [None]))
        )

    async def held(self) -> Done:
        """What the copy held after its last batch (read there, on the member's thread, before the batch's
        replies went out): a :class:`Held`, at once, however busy the member is."""
        seen = self.loop.seen
        held = Held(seen.occupancy, seen.sessions, seen.stats, self.about, self.loop.waiting)
        return Done([held], seen.sessions, [None])

    async def _run(self, job: CopyJob) -> Done:
        return await asyncio.wrap_future(self.loop.submit(job))


@functools.cache
def _actor_class() -> Any:
    return ray.remote(MemberHost)


def create_hosts(
    inner: str,
    shared: MemberOptions | None,
    settings: RaySettings,
    *,
    name: str | None = None,
    namespace: str | None = None,
) -> list[Any]:
    """Start ``settings.replicas`` copies of the member `inner` (a member spec) under the ensemble's `shared`
    options, spread over the cluster's nodes; their actor handles, not waited for (``info`` says when
    each is loaded). `name`: copy k is the named actor ``NAME-k`` (in `namespace`), for other processes."""
    where = placement(settings, shared, inner)
    options = {**(shared.given() if shared else {}), "threads": where.threads}
    if where.gpu_layers is not None:
        options["gpu_layers"] = where.gpu_layers
    handles = []
    for k in range(settings.replicas):
        actor: dict[str, Any] = {
            "num_cpus": where.cpus,
            "num_gpus": where.gpus,
            "max_restarts": settings.restarts,
            "scheduling_strategy": "SPREAD",
        }
        if name is not None:
            actor.update(name=f"{name}-{k}", namespace=namespace)
        handles.append(_actor_class().options(**actor).remote(inner, options, settings.expire_s, settings.gather_ms))
    return handles
