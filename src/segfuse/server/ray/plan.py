"""Which members run as copies in Ray actors, loaded with what, and what they ask the cluster for.

Each ``-m SPEC`` becomes a Ray member of that spec (``ray:`` is implied; the Ray member's keys, such
as ``replicas=2`` or ``cpus=1``, go in the spec's ``#...`` part: docs/deploy.md). A ``remote:`` member
is a client of a server elsewhere: each front end loads its own, as `segfuse serve` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...backends.ray.settings import RaySettings, parse_target, placement
from ...config import ServerConfig
from ...member_options import MemberOptions
from ...models import DEFAULT_MODELS

REMOTE = "remote:"


@dataclass(frozen=True)
class Planned:
    """One configured member."""

    spec: str  # as configured
    inner: str | None  # the member each copy runs; None: a remote member, loaded by each front end
    settings: RaySettings


def plan(config: ServerConfig) -> list[Planned]:
    """The configured members (the embedded three when none are named), in order; a bad Ray key is refused."""
    planned = []
    for spec in config.members.models or DEFAULT_MODELS:
        if spec.startswith(REMOTE):
            planned.append(Planned(spec, None, RaySettings()))
            continue
        inner, settings = parse_target(spec.removeprefix("ray:"))
        planned.append(Planned(spec, inner, settings))
    return planned


def copy_options(config: ServerConfig) -> MemberOptions:
    """What every copy loads its member with: the ``[members]`` table, and a slot for each generation the
    front ends may run at once (``max_concurrent`` each); a spec's own ``#slots=`` goes over it."""
    slots = config.server.max_concurrent * config.ray.replicas
    return MemberOptions.build({**config.members.load_options().given(), "slots": slots}, where="[members]")


def cpus_asked(config: ServerConfig) -> tuple[float, float]:
    """(CPUs the application asks Ray for in all, the most one actor asks for): copies and front ends."""
    shared = copy_options(config)
    asks = [config.ray.frontend_cpus] * config.ray.replicas
    for p in plan(config):
        if p.inner is not None:
            asks += [placement(p.settings, shared, p.inner).cpus] * p.settings.replicas
    return sum(asks), max(asks, default=0.0)


def remote_options(config: ServerConfig) -> dict[str, object]:
    """What a front end loads its remote members with (as `segfuse serve` loads its members)."""
    return {**config.members.load_options().given(), "slots": config.server.max_concurrent}


__all__ = ["Planned", "copy_options", "cpus_asked", "plan", "remote_options"]
