"""A member whose copies run in Ray actors: to the engine, one member like any other.

Spec: ``ray:INNER_SPEC[#NAME,KEY=VALUE,...]`` (``settings.py``), e.g.
``ray:qwen2.5-coder-0.5b#replicas=2``: two copies of that member, each a Ray actor
(``host.py``) placed by resources and spread over the nodes. Or from code, over copies someone
else started: ``RayMember(create_hosts(...))``.

What it declares is the inner member's (batched, prompt fit, constrained, echo...), plus
``parallel_safe``: its calls run elsewhere, so they overlap the other members'. Its slots are the
copies' together. A session stays on the copy that holds its cache (``session.py``);
``draft_many`` and ``score_many`` send one call per copy for that copy's sessions, and the copy
batches them with its other callers' (``loop.py``). A draft asked to stream (the leader's text)
hands its text to the hook as the copy samples it.

Faults: a session whose copy is lost is read again on another copy and the call made again,
unseen by the engine, as long as none of the failed call's text went out (a draft that streamed
text is not drafted again, since a retry might not write the same); otherwise, or with no copy
left, the call raises and the engine's failover takes over (the member leaves the answer).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import ray
from ray.exceptions import RayActorError

from ...errors import MemberLoadError
from ...member_options import MemberOptions
from ...types import DraftTokens, Message, PromptToken, Sampling, TokenScores
from ..base import Member, Occupancy, OnText, SessionOptions
from ..prefix_cache import PrefixStats
from .copies import Copies, Copy
from .host import create_hosts
from .session import RaySession
from .settings import RaySettings, parse_target
from .wire import CopyLost, Done, HostInfo, SessionLost


class RayMember(Member):
    """A member over Ray actors that each run a copy of it (module docstring)."""

    def __init__(self, hosts: Sequence[Any], settings: RaySettings | None = None, *, owned: bool = False) -> None:
        """`hosts`: the copies' actor handles (``create_hosts``); `owned`: they are this member's, killed by
        :meth:`close` (else they belong to whoever started them)."""
        if not hosts:
            raise MemberLoadError("a Ray member needs at least one copy", "give replicas=1 or more")
        self.settings = settings or RaySettings()
        self.hosts, self.owned = list(hosts), owned
        infos = _infos(self.hosts, self.settings)
        first = infos[0]
        if any(i.name != first.name for i in infos):
            raise MemberLoadError(
                f"the copies run different members: {sorted({i.name for i in infos})}",
                "give a Ray member copies of one member",
            )
        self.name, self.n_params = first.name, first.n_params
        # (its sessions do not forward ``speculate``: a Ray leader answers alone, not reading drafts)
        self.capabilities = replace(first.capabilities, parallel_safe=True, speculates=False)
        self.slots = None if any(i.slots is None for i in infos) else sum(i.slots or 0 for i in infos)
        self.copies = Copies(self.hosts, infos, name=self.name, timeout=self.settings.timeout)
        self.stats: Counter[str] = Counter()  # sessions read again ("reread")
        self._lead: list[int] | None = None

    @property
    def placement(self) -> str:  # type: ignore[override]  # the base's attribute, read off the copies here
        where = ", ".join(
            f"{c.info.node_ip} {c.info.placement or '?'}" + ("" if c.up else " (down)") for c in self.copies.all
        )
        return f"Ray, {len(self.copies.all)} {'copy' if len(self.copies.all) == 1 else 'copies'}: {where}"

    # --- sessions -----------------------------------------------------------------------------------
    def new_session(self, messages: Sequence[Message], options: SessionOptions) -> RaySession:
        start: dict[str, Any] = {"seed": options.seed, "reserve": options.reserve}
        if options.cache_salt is not None:
            start["cache_salt"] = options.cache_salt
        if options.deterministic:
            start["deterministic"] = True
        session = RaySession(self, messages, start)
        session.open()
        return session

    def draft_many(
        self,
        sessions: Sequence[RaySession],  # type: ignore[override]  # the scheduler hands a member its own sessions
        requests: Sequence[tuple[Any, ...]],
    ) -> list[DraftTokens | Exception]:
        """One streaming call per copy for its sessions' drafts; a hook gets its draft's text as it comes."""
        return self._many(
            "draft", sessions, [_draft_item(r) for r in requests], [r[2] if len(r) > 2 else None for r in requests]
        )

    def score_many(
        self,
        sessions: Sequence[RaySession],  # type: ignore[override]  # the scheduler hands a member its own sessions
        requests: Sequence[tuple[Sequence[str]]],
    ) -> list[list[TokenScores] | Exception]:
        return self._many("score", sessions, [(list(r[0]),) for r in requests], [None] * len(requests))

    def _many(
        self, kind: str, sessions: Sequence[RaySession], items: list[tuple[Any, ...]], hooks: list[OnText | None]
    ) -> list[Any]:
        """Each session's result or exception; sessions whose copy was lost are read again and asked again,
        except a draft whose text went out already."""
        out: list[Any] = [None] * len(sessions)
        streamed = [False] * len(sessions)
        todo = list(range(len(sessions)))
        for _ in range(len(self.copies.all) + 1):
            if not todo:
                return out
            groups: dict[Copy, list[int]] = {}
            for i in todo:
                groups.setdefault(sessions[i].copy, []).append(i)  # type: ignore[arg-type]  # open: has a copy
            again: list[tuple[int, Copy | None]] = []
            for copy, done in self._send(kind, groups, sessions, items, hooks, streamed):
                indices = groups[copy]
                if isinstance(done, CopyLost):
                    for i in indices:
                        if streamed[i]:
                            out[i] = CopyLost(
                                f"{self.name}: its copy was lost after part of the draft went out",
                                "a draft again might not repeat it: the member leaves the answer",
                            )
                        else:
                            again.append((i, copy))
                    continue
                for i, value in zip(indices, done.values):
                    if isinstance(value, SessionLost):
                        again.append((i, None))
                    else:
                        out[i] = value
            todo = []
            for i, lost in again:
                try:
                    sessions[i].recover(lost)
                    todo.append(i)
                except Exception as exc:
                    out[i] = exc
        for i in todo:
            out[i] = CopyLost(f"{self.name}: the session was lost on every copy", "the member leaves the answer")
        return out

    def _send(
        self,
        kind: str,
        groups: dict[Copy, list[int]],
        sessions: Sequence[RaySession],
        items: list[tuple[Any, ...]],
        hooks: list[OnText | None],
        streamed: list[bool],
    ) -> list[tuple[Copy, Done | CopyLost]]:
        """One call per copy, all in flight together; each copy's Done, or CopyLost where it is gone. A draft's
        texts go to its hook as they come, on this thread."""
        calls: dict[Any, Copy] = {}
        for copy, indices in groups.items():
            batch = [(sessions[i].sid, *items[i]) for i in indices]
            if kind == "draft":
                calls[copy.handle.draft.options(num_returns="streaming").remote(batch)] = copy
            else:
                calls[copy.handle.score.remote(batch)] = copy
        results: list[tuple[Copy, Done | CopyLost]] = []
        pending = list(calls)
        while pending:
            ready, _ = ray.wait(pending, num_returns=1, timeout=self.settings.timeout)
            if not ready:
                return results + [(calls[p], self.copies.lost(calls[p], TimeoutError("no reply"))) for p in pending]
            call, copy = ready[0], calls[ready[0]]
            try:
                event = ray.get(next(call) if kind == "draft" else call)  # type: ignore[arg-type]  # a draft: a stream
            except StopIteration:  # a stream that ended without its Done
                event = RayActorError()
            except RayActorError as exc:
                event = exc
            if isinstance(event, tuple):  # (item, text so far) of a draft that streams
                i = groups[copy][event[0]]
                streamed[i] = True
                hook = hooks[i]
                if hook is not None:
                    hook(event[1])
                continue
            pending.remove(call)
            if isinstance(event, Done):
                copy.load = event.load
                results.append((copy, event))
            else:
                results.append((copy, self.copies.lost(copy, event)))
        return results

    # --- the member's own calls (any live copy) ------------------------------------------------------
    def _any(self, method: str, *args: Any) -> Any:
        for copy in self.copies.choose(()):
            try:
                return self.copies.get(copy, copy.handle.call.remote(method, args))
            except CopyLost:
                continue
        raise CopyLost(f"no copy of {self.name} is up", "Ray restarts its copies where it can; retry later")

    def prompt_tokens(self, messages: Sequence[Message]) -> list[int] | None:
        return cast("list[int] | None", self._any("prompt_tokens", list(messages)))

    def tokenize_text(self, text: str) -> list[int] | None:
        return cast("list[int] | None", self._any("tokenize_text", text))

    def lead_tokens(self) -> list[int]:
        if self._lead is None:
            self._lead = self._any("lead_tokens")
        return list(self._lead)

    def detokenize(self, tokens: Sequence[int]) -> str | None:
        return cast("str | None", self._any("detokenize", list(tokens)))

    def echo(self, prompt: str | Sequence[int], top_k: int = 0) -> list[PromptToken]:
        return cast(list[PromptToken], self._any("echo", prompt if isinstance(prompt, str) else list(prompt), top_k))

    # --- what the copies hold --------------------------------------------------------------------------
    def occupancy(self) -> Occupancy:
        """The copies' occupancies added up (slots of copies that are up); each copy's is in :meth:`view`."""
        self.refresh()
        held = [c.held.occupancy for c in self.copies.up() if c.held is not None]
        return Occupancy(
            slots=_total(o.slots for o in held),
            free_slots=_total(o.free_slots for o in held),
            cache_cells=_total(o.cache_cells for o in held),
            stray_cells=_total(o.stray_cells for o in held),
            prefix=_prefix_total([o.prefix for o in held]),
        )

    def refresh(self) -> None:
        """Ask every copy what it holds (``Copy.held``); a copy that does not answer is down."""
        self.copies.revive()
        up = self.copies.up()
        refs = [c.handle.held.remote() for c in up]
        for copy, ref in zip(up, refs):
            try:
                copy.held = self.copies.get(copy, ref)
            except CopyLost:
                continue
            copy.load = copy.held.sessions
            copy.info = copy.held.info  # new where Ray restarted it since

    def view(self) -> list[dict[str, Any]]:
        """Each copy: where it runs, whether it is up, its sessions and free slots, the calls waiting for it,
        its prefix-cache hits, and its work so far (as last read by :meth:`occupancy` or :meth:`refresh`)."""
        rows = []
        for c in self.copies.all:
            held = c.held
            prefix = held.occupancy.prefix if held else None
            rows.append(
                {
                    "copy": c.index,
                    "node_id": c.info.node_id,
                    "node_ip": c.info.node_ip,
                    "pid": c.info.pid,
                    "placement": c.info.placement,
                    "up": c.up,
                    "sessions": c.load,
                    "slots": c.info.slots,
                    "free_slots": held.occupancy.free_slots if held else None,
                    "waiting": held.waiting if held else None,
                    "prefix_hits": prefix.hits if prefix else None,
                    "stats": dict(held.stats) if held else {},
                }
            )
        return rows

    def close(self) -> None:
        """Kill the copies where this member started them (``owned``); others belong to whoever did."""
        if self.owned:
            for handle in self.hosts:
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # already gone, or Ray is shutting down
                    pass
        self.hosts = []


def _draft_item(request: tuple[Any, ...]) -> tuple[int, Sampling, bool]:
    """A draft request as the copy takes it: (max_tokens, sampling, whether its text streams)."""
    max_tokens, sampling, *hook = request
    return (max_tokens, sampling, bool(hook) and hook[0] is not None)


def _infos(hosts: Sequence[Any], settings: RaySettings) -> list[HostInfo]:
    """Each copy's info once it loaded; its own error where loading failed (or it died starting)."""
    refs = [h.info.remote() for h in hosts]
    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=settings.timeout)
    if waiting:
        raise MemberLoadError(
            f"{len(waiting)} of {len(refs)} copies did not start within {settings.timeout:g} s",
            "the cluster may lack the CPUs or GPUs each copy asks for (cpus=, gpus=), see `ray status`",
        )
    infos = []
    for ref in refs:
        try:
            info = ray.get(ref)
        except RayActorError as exc:
            raise MemberLoadError(
                f"a copy died while it started: {str(exc).splitlines()[0]}", "see the Ray logs of its worker"
            ) from None
        if isinstance(info, BaseException):
            raise info
        infos.append(info)
    return infos


def _total(values: Any) -> int | None:
    values = list(values)
    return None if not values or any(v is None for v in values) else sum(values)


def _prefix_total(stats: list[PrefixStats | None]) -> PrefixStats | None:
    if not stats or any(s is None for s in stats):
        return None
    fields = PrefixStats.__dataclass_fields__
    return PrefixStats(**{f: sum(getattr(s, f) for s in stats) for f in fields})


def join(address: str | None) -> None:
    """Join the Ray cluster at `address` (or $RAY_ADDRESS) unless this process has joined one."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise MemberLoadError(
            "ray: members need a Ray cluster, and this process has joined none",
            "call ray.init(...) first, set RAY_ADDRESS, or add address=HOST:PORT to the spec",
        )
    ray.init(address=address)


def load(target: str, shared: MemberOptions | None = None) -> RayMember:
    """Registry entry: start the copies of ``ray:INNER#...`` and wait until each has loaded its member."""
    inner, settings = parse_target(target)
    join(settings.address)
    hosts = create_hosts(inner, shared, settings)
    try:
        return RayMember(hosts, settings, owned=True)
    except BaseException:
        for handle in hosts:
            ray.kill(handle, no_restart=True)
        raise
