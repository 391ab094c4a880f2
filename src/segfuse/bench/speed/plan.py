"""What one `segfuse bench` run measures (:class:`Plan`), and the choices the members settle: the reference
method re-encodes through llama.cpp members only, and peak RSS says nothing of a member on a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...backends.registry import MemberSpec
from ...ensemble import Ensemble
from ...errors import SegfuseError
from .systems import on_gpu


@dataclass(frozen=True)
class Plan:
    """What a run measures. None: decided by the members (``settle``): `rss` on unless a member is on a GPU,
    `reference` on when every member is a llama.cpp one (only they re-encode). `users` 0: no users rows.
    `deadline` (``time.monotonic``): no repetition starts past it."""

    lengths: tuple[int, ...] = (128, 256)
    reps: int = 3
    window: int = 10
    users: int = 4
    rss: bool | None = None
    reference: bool | None = None
    response_level: bool = True
    plot: bool = True
    deadline: float | None = None
    skipped: tuple[str, ...] = field(default=())


def check_reference(plan: Plan, specs: list[str]) -> Plan:
    """Settle `reference` from the specs, before anything loads: the reference method re-encodes through
    llama.cpp members only."""
    llama = all(MemberSpec.parse(s).backend == "llama_cpp" for s in specs)
    if plan.reference and not llama:
        raise SegfuseError(
            "the reference method re-encodes through llama.cpp members only", "add --no-reference for these members"
        )
    if plan.reference is None and not llama:
        return replace(
            plan, reference=False, skipped=(*plan.skipped, "reference method: not every member is llama.cpp")
        )
    return replace(plan, reference=plan.reference is not False)


def settle(plan: Plan, ens: Ensemble) -> Plan:
    """Settle `rss` once the members are loaded (RSS measures nothing of a member on a GPU), and list what the
    run leaves out because it was told to."""
    gpu = [m.name for m in ens.members if on_gpu(m)]
    if plan.rss and gpu:
        raise SegfuseError(f"{', '.join(gpu)} on a GPU: peak RSS says nothing there", "add --no-rss")
    told = {
        "reference method: --no-reference": plan.reference is False and not _listed(plan, "reference method"),
        "response level: --no-response-level": not plan.response_level,
        "RSS: --no-rss": plan.rss is False,
        "users: --users 0": not plan.users,
    }
    skipped = (*plan.skipped, *(why for why, left_out in told.items() if left_out))
    if plan.rss is None and gpu:
        return replace(plan, rss=False, skipped=(*skipped, f"RSS: {', '.join(gpu)} on a GPU"))
    return replace(plan, rss=plan.rss is not False, skipped=skipped)


def _listed(plan: Plan, what: str) -> bool:
    return any(why.startswith(what) for why in plan.skipped)
