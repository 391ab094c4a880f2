"""The systems `segfuse bench` times, the prompts it times them on, and how one answer of each is run.

Every answer is greedy and forced to its full length (``ignore_eos``), so every system writes the same
number of tokens from the same prompt. The systems, by the name the report prints, and the options that
make each (over :class:`~segfuse.options.FusionOptions`' defaults): *plain fusion* (no gate, every proposal
to the vote: every member drafts and verifies every round, the method's full cost) and the *default* (the
leader alone: the others never start). Model Exit's savings are measured in docs/results-256.md.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...backends.base import Member
from ...ensemble import Ensemble
from ...options import FusionOptions
from ...types import Message, Result, Sampling

PROMPTS = (
    "Write a detailed essay about the history of the printing press and how it changed Europe.",
    "Explain step by step how a compiler turns source code into machine code, with examples.",
    "Describe the water cycle in detail, covering evaporation, condensation, precipitation and runoff.",
)
GREEDY = Sampling(temperature=0.0, top_p=1.0, seed=0, ignore_eos=True)
PLAIN = "plain fusion"
DEFAULT = "default (leader alone)"
SYSTEMS: dict[str, dict[str, Any]] = {
    PLAIN: {"gate": None, "accept_margin": None, "exit": False, "hedge": False},
    DEFAULT: {},
}
SHOWN_OPTIONS = ("gate", "accept_margin", "exit", "hedge", "leader", "followers")
ROW_PREFIX = {PLAIN: "fusion", DEFAULT: "default"}  # the report's rows of each system start so


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def fusion_options(length: int, window: int, system: str) -> dict[str, Any]:
    """The generate options of one greedy answer of exactly `length` tokens from `system` (a key of SYSTEMS)."""
    return {
        "max_tokens": length,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "ignore_eos": True,
        "window": window,
        **SYSTEMS[system],
    }


def run_fusion(ensemble: Ensemble, prompt: str, length: int, window: int, system: str = PLAIN) -> Result:
    """One greedy answer of exactly `length` tokens from `system` (a key of SYSTEMS)."""
    return ensemble.generate(prompt, **fusion_options(length, window, system))


def system_options(system: str, window: int) -> dict[str, Any]:
    """The options that tell the systems apart, as the engine resolves them (defaults included)."""
    options = FusionOptions.build(**SYSTEMS[system], window=window).model_dump()
    return {k: options[k] for k in ("window", *SHOWN_OPTIONS)}


def describe_systems(window: int) -> list[str]:
    """One line per system: its name and options, as printed before the table."""

    def shown(value: Any) -> Any:
        return "none" if value is None else value

    return [
        f"{name}: " + ", ".join(f"{k}={shown(v)}" for k, v in system_options(name, window).items()) for name in SYSTEMS
    ]


def member_alone_seconds(member: Member, messages: Sequence[Message], length: int) -> float:
    """One member generating `length` tokens by itself through its own session (its backend's loop):
    prefill + decode."""
    t0 = time.perf_counter()
    session = member.start(messages, seed=0, reserve=length + 1)
    try:
        session.draft(length, GREEDY)
    finally:
        session.close()
    return time.perf_counter() - t0


def default_leader(result: Result) -> str:
    """The member that answered under the default: the one that drafted (the others stay on standby)."""
    return max(result.counters, key=lambda name: result.counters[name]["draft"])


def on_gpu(member: Member) -> bool:
    """Whether a member computes on a GPU (its placement names no CPU alone)."""
    return (member.placement or "CPU") != "CPU"
