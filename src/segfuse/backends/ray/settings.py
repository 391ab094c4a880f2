"""A Ray member's spec: ``ray:INNER_SPEC[#NAME,KEY=VALUE,...]``, its own keys split from the inner member's.

The inner spec is any other member's (``qwen2.5-coder-0.5b``, ``/m/x.gguf``,
``transformers:PATH``); the keys below are the Ray member's, every other item
of the fragment (the display name, ``threads=1``, ``slots=4``...) goes to the
inner member as if written after its own ``#``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import InvalidRequestError
from ...member_options import MemberOptions
from ..spec import split_target

# key -> type; what each means is in RaySettings
RAY_KEYS: dict[str, type] = {
    "replicas": int,
    "cpus": float,
    "gpus": float,
    "expire_s": float,
    "gather_ms": float,
    "restarts": int,
    "timeout": float,
    "address": str,
}
CPU_THREADS = 4  # llama.cpp threads of a copy on the CPU when neither threads nor cpus is given
GPU_THREADS = 2  # ... of a copy with a GPU (what stays on the CPU is small)


@dataclass(frozen=True)
class RaySettings:
    """How a Ray member's copies are placed and looked after."""

    replicas: int = 1  # copies of the member, each a Ray actor
    cpus: float | None = None  # CPUs each copy asks Ray for (default: its threads)
    gpus: float | None = None  # GPUs each copy asks Ray for (default: 1 when gpu_layers is set and not 0)
    expire_s: float = 300.0  # a session no call touched for this long is closed on its copy (its caller died)
    gather_ms: float = 2.0  # how long a copy waits for other callers' drafts and scores to batch them (0: never)
    restarts: int = 3  # times Ray restarts a dead copy (-1: always)
    timeout: float = 600.0  # seconds a call (or placing the copies) may take before it counts as a fault
    address: str | None = None  # the Ray cluster to join when none is joined yet ("auto", HOST:PORT)

    def __post_init__(self) -> None:
        checks = [
            (self.replicas >= 1, "replicas must be at least 1"),
            (self.cpus is None or self.cpus > 0, "cpus must be more than 0"),
            (self.gpus is None or self.gpus >= 0, "gpus must be 0 or more"),
            (self.expire_s > 0, "expire_s must be more than 0"),
            (self.gather_ms >= 0, "gather_ms must be 0 or more"),
            (self.restarts >= -1, "restarts must be -1 (always) or more"),
            (self.timeout > 0, "timeout must be more than 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(f"ray member: {message}", "see Ray members in docs/deploy.md")


@dataclass(frozen=True)
class Placement:
    """What one copy asks Ray for and the inner member's threads and GPU layers to match."""

    cpus: float
    gpus: float
    threads: int
    gpu_layers: int | None


def parse_target(target: str) -> tuple[str, RaySettings]:
    """``INNER[#ITEMS]`` -> (the inner member's spec with its own items, the Ray member's settings)."""
    head, _, fragment = target.partition("#")
    if not head or head.startswith("ray:"):
        raise InvalidRequestError(
            f"ray member {target!r} names no member to run", "write ray:SPEC, e.g. ray:qwen2.5-coder-0.5b#replicas=2"
        )
    items = [part.strip() for part in fragment.split(",") if part.strip()]
    ours = [item for item in items if _key(item) in RAY_KEYS]
    theirs = [item for item in items if item not in ours]
    _, typed = split_target("#" + ",".join(ours), RAY_KEYS, "ray")
    return head + ("#" + ",".join(theirs) if theirs else ""), RaySettings(**typed)


def _key(item: str) -> str | None:
    key, eq, _ = item.partition("=")
    return key.strip().replace("-", "_") if eq else None


def placement(settings: RaySettings, shared: MemberOptions | None, inner: str) -> Placement:
    """CPUs, GPUs, threads and GPU layers of one copy, from the settings and the inner member's options
    (the ensemble's `shared` ones under its spec's own): a copy asks Ray for as many CPUs as it runs
    threads, and for a GPU when its layers go to one; a copy given no GPU offloads nothing."""
    given = {**(shared.given() if shared else {}), **_numbers(inner, ("threads", "gpu_layers"))}
    layers = given.get("gpu_layers")
    gpus = settings.gpus if settings.gpus is not None else (1.0 if layers not in (None, 0) else 0.0)
    threads = given.get("threads")
    if threads is None:
        asked = settings.cpus
        threads = max(1, math.floor(asked)) if asked is not None else (GPU_THREADS if gpus else CPU_THREADS)
    cpus = settings.cpus if settings.cpus is not None else float(threads)
    return Placement(cpus, gpus, int(threads), layers if gpus else 0)


def _numbers(inner: str, keys: tuple[str, ...]) -> dict[str, int]:
    """The integer `keys` an inner spec gives itself (a bad value is left for the inner member to refuse)."""
    fragment = inner.partition("#")[2]
    found = {}
    for item in fragment.split(","):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if eq and key in keys:
            try:
                found[key] = int(value.strip())
            except ValueError:
                pass
    return found
