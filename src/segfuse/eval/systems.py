"""The compared systems, a small registry keyed by name.

Built in:
- ``specfuse``: plain fusion, no Model Exit, no Hedge (greedy or seeded as the run says);
- ``specfuse+exit``, ``specfuse+hedge``, ``specfuse+exit+hedge``: with Model Exit and/or Hedge;
- ``rerank``: the response-level ensemble (:func:`segfuse.eval.baselines.rerank`);
- ``specfuse+guard``: plain fusion with the degeneration guard;
- ``specfuse+gate``: the default engine since the 512-token study (the largest member
  leads, confidence gate 0.5; no guard, no Exit, no Hedge);
- ``specfuse+lead``: the same with the degeneration guard (studied, not the default);
- ``default``: the engine exactly as ``FusionOptions`` defaults it *at the time of the
  run* (each record keeps the options it ran with);
- ``fusion:KEY=VALUE/KEY=VALUE``: any FusionOptions variant, for screening
  (e.g. ``fusion:gate=0.7/guard=true/prior=prompt``);
- ``member:<name>``: one member alone (:func:`segfuse.eval.baselines.write_answer`);
  ``members`` expands to every member.

A variant of the engine is one line::

    register("specfuse+exit", fusion_system(exit=True))   # extra FusionOptions fields
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import Member
from ..engine import member_seed
from ..ensemble import Ensemble
from ..errors import InvalidRequestError
from ..options import FusionOptions
from ..request import FusionRequest
from ..types import Message, Sampling
from .baselines import MemberAnswer, SystemOutput, answer_output, fused, rerank, write_answer

MEMBER_PREFIX = "member:"
FUSION_PREFIX = "fusion:"


@dataclass(frozen=True)
class RunSettings:
    """What every system of one run shares (recorded with each result)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    window: int = 10
    stop: tuple[str, ...] = ()  # extra stop strings (lm-eval's `until`); none in our own tasks
    hedge_persist: bool = False  # Hedge presets start each item from the weights the previous item ended with
    options: dict[str, Any] = field(default_factory=dict)  # fusion options for every fusion system (over presets)

    def sampling(self, member_index: int) -> Sampling:
        """Member i samples with the engine's per-member seed, so alone and in rerank it says the same."""
        return Sampling(self.temperature, self.top_p, member_seed(self.seed, member_index))


@dataclass
class ItemContext:
    """The loaded members plus answers already written for the current prompt.

    Member-alone answers are kept for the prompt being evaluated so that
    ``rerank`` reuses them (same prompt, same sampling, same seed: the same
    answer) and counts their measured cost instead of writing them again.
    """

    ensemble: Ensemble
    answers: dict[str, MemberAnswer] = field(default_factory=dict)
    system: str = ""  # the system being run (set by the runner)
    carried: dict[str, dict[str, float]] = field(default_factory=dict)  # per system, across items of a run

    @property
    def members(self) -> Sequence[Member]:
        return self.ensemble.members

    def member(self, name: str) -> tuple[int, Member]:
        for i, member in enumerate(self.members):
            if member.name == name:
                return i, member
        raise InvalidRequestError(f"no member named {name!r}", f"members: {', '.join(m.name for m in self.members)}")


SystemFn = Callable[[ItemContext, list[Message], RunSettings], SystemOutput]
SYSTEMS: dict[str, SystemFn] = {}


def register(name: str, fn: SystemFn) -> None:
    """Add (or replace) a named system."""
    SYSTEMS[name] = fn


def split_members(values: Mapping[str, object]) -> tuple[list[str] | None, dict[str, object]]:
    """The ``members`` of fusion settings (None: all), and the FusionOptions fields."""
    members = values.get("members")
    chosen = [str(m) for m in members] if isinstance(members, list | tuple) else None
    return chosen, {k: v for k, v in values.items() if k != "members"}


def fusion_system(**options: object) -> SystemFn:
    """A system running the engine with `options` added to FusionOptions, on the ``members`` they name
    (default: all).

    With ``RunSettings.hedge_persist`` a Hedge preset carries its weights from
    one item to the next (``ItemContext.carried``, kept by the runner and
    restored from the JSONL records on resume): a per-task prior.
    """
    members, extra_options = split_members(options)

    def run(ctx: ItemContext, messages: list[Message], s: RunSettings) -> SystemOutput:
        fusion = FusionOptions.build(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            window=s.window,
            stop=s.stop,
            **{**extra_options, **s.options},
        )
        persist = s.hedge_persist and fusion.hedge
        request = FusionRequest.of(
            messages, fusion, members=members, weights=ctx.carried.get(ctx.system) if persist else None
        )
        output = fused(ctx.ensemble, request)
        if persist and output.weights:
            ctx.carried[ctx.system] = output.weights
        return output

    return run


def _rerank(ctx: ItemContext, messages: list[Message], s: RunSettings) -> SystemOutput:
    answers = [ctx.answers.get(m.name) for m in ctx.members]
    return rerank(
        ctx.members,
        messages,
        max_tokens=s.max_tokens,
        sampling=Sampling(s.temperature, s.top_p, s.seed),
        stop=s.stop,
        answers=answers,
    )


def _member(name: str) -> SystemFn:
    def run(ctx: ItemContext, messages: list[Message], s: RunSettings) -> SystemOutput:
        index, member = ctx.member(name)
        answer = write_answer(member, messages, max_tokens=s.max_tokens, sampling=s.sampling(index), stop=s.stop)
        ctx.answers[name] = answer
        return answer_output(answer)

    return run


# Presets name their switches explicitly, so a recorded "specfuse" stays plain fusion whatever
# the engine's defaults; the knobs of Model Exit and Hedge are the documented option defaults.
PLAIN = {
    "exit": False,
    "hedge": False,
    "guard": False,
    "gate": None,
    "prior": "uniform",
    "accept_margin": None,
}  # the paper's
register("specfuse", fusion_system(**PLAIN))
register("specfuse+exit", fusion_system(**{**PLAIN, "exit": True}))
register("specfuse+hedge", fusion_system(**{**PLAIN, "hedge": True}))
register("specfuse+exit+hedge", fusion_system(**{**PLAIN, "exit": True, "hedge": True}))
register("rerank", _rerank)
# Everything the selection study switches, named: leader by prompt fit, gate, guard, prior.
LEAD = {
    "exit": False,
    "hedge": False,
    "guard": True,
    "prior": "uniform",
    "gate": 0.5,
    "leader": "auto",
    "exit_votes": "all",
    "accept_margin": None,
}
register("specfuse+guard", fusion_system(**{**PLAIN, "guard": True}))
register("specfuse+lead", fusion_system(**LEAD))
GATE = {**LEAD, "guard": False}  # the default engine since the 512-token study
register("specfuse+gate", fusion_system(**GATE))
# The leader verifies (docs/results.md): proposals it accepts within 2 nats per token go to the vote.
register("specfuse+verify", fusion_system(**{**GATE, "accept": "worst", "accept_margin": 2.0}))
register("default", fusion_system())


def parse_fusion(spec: str) -> dict[str, object]:
    """``gate=0.7/guard=true/prior=prompt`` -> FusionOptions fields (validated when run).

    ``members=A+B`` runs the engine on those members of the run only.
    """
    values: dict[str, object] = {}
    for part in filter(None, spec.split("/")):
        key, sep, text = part.partition("=")
        if key == "members" and sep:
            values["members"] = [m for m in text.split("+") if m]
            continue
        if not sep or key not in FusionOptions.model_fields:
            raise InvalidRequestError(f"bad fusion option {part!r}", "write KEY=VALUE with a FusionOptions field")
        lowered = text.lower()
        value: object = {"true": True, "false": False, "none": None}.get(lowered, text)
        if value is text:
            try:
                value = int(text) if text.lstrip("-").isdigit() else float(text)
            except ValueError:
                value = text
        values[key] = value
    FusionOptions.build(**split_members(values)[1])  # fail early on a bad value
    return values


def get_system(name: str) -> SystemFn:
    if name.startswith(MEMBER_PREFIX):
        return _member(name[len(MEMBER_PREFIX) :])
    if name.startswith(FUSION_PREFIX):
        return fusion_system(**parse_fusion(name[len(FUSION_PREFIX) :]))
    try:
        return SYSTEMS[name]
    except KeyError:
        known = ", ".join([*SYSTEMS, "members", f"{MEMBER_PREFIX}<name>", f"{FUSION_PREFIX}KEY=VALUE/..."])
        raise InvalidRequestError(f"unknown system {name!r}", f"choose from {known}") from None


def resolve_systems(spec: str | Sequence[str], member_names: Sequence[str]) -> list[str]:
    """Expand "members", check names, and order members first so rerank can reuse their answers."""
    names = [n.strip() for part in ([spec] if isinstance(spec, str) else spec) for n in part.split(",")]
    expanded: list[str] = []
    for name in filter(None, names):
        group = [MEMBER_PREFIX + m for m in member_names] if name == "members" else [name]
        for item in group:
            if item.startswith(MEMBER_PREFIX) and item[len(MEMBER_PREFIX) :] not in member_names:
                raise InvalidRequestError(f"{item}: not a member of this run", f"members: {', '.join(member_names)}")
            if item.startswith(FUSION_PREFIX):
                chosen, _ = split_members(parse_fusion(item[len(FUSION_PREFIX) :]))
                unknown = [m for m in chosen or [] if m not in member_names]
                if unknown:
                    raise InvalidRequestError(
                        f"{item}: {unknown[0]} is not a member of this run", f"members: {', '.join(member_names)}"
                    )
            get_system(item)
            if item not in expanded:
                expanded.append(item)
    if not expanded:
        raise InvalidRequestError("no systems given", "e.g. --systems specfuse,rerank,members")
    return sorted(expanded, key=lambda n: 0 if n.startswith(MEMBER_PREFIX) else 1)
