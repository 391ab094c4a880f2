"""The public Python API: an Ensemble of loaded members."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from .backends.base import Member
from .backends.registry import load_member
from .constraints import Constraint
from .echo import echo_text
from .engine import Steps, drive, fusion_steps, run_all
from .errors import InvalidRequestError
from .hedge_store import MemoryWeights, WeightStore
from .likelihood import ItemScores, Rule, score_item, score_items
from .member_options import MAX_CONCURRENT, MemberOptions
from .models import DEFAULT_MODELS
from .options import FusionOptions
from .request import Conversation, FusionRequest
from .types import DoneEvent, Event, PromptToken, Result

MAX_MEMBERS = 7


class Ensemble:
    """Several members answering together, one verified segment at a time.

    >>> with Ensemble() as ens:                       # the embedded default models
    ...     print(ens.generate("Name three primary colors.", max_tokens=48).text)
    """

    def __init__(
        self,
        members: Sequence[str | Member] | None = None,
        *,
        hedge_persist: bool = False,
        hedge_store: WeightStore | None = None,
        **member_options: Any,
    ) -> None:
        """`hedge_persist`: every query with Hedge on, over all members and without given weights, starts
        from the weights the previous such query ended with (state of this object, shared by all its
        callers: a setting of whoever owns the Ensemble, never of one request), kept in `hedge_store`
        (default: in memory). `member_options` go to each member's loader, validated once
        (:class:`segfuse.member_options.MemberOptions`)."""
        shared = MemberOptions.build(member_options)
        specs = list(members) if members else list(DEFAULT_MODELS)
        if len(specs) > MAX_MEMBERS:
            raise InvalidRequestError(f"{len(specs)} members given", f"use at most {MAX_MEMBERS}")
        self.members: list[Member] = []
        # What each member was loaded from (None: given loaded): a server that loads more knows them.
        self.specs: list[str | None] = [spec if isinstance(spec, str) else None for spec in specs]
        try:
            for spec in specs:
                self.members.append(spec if not isinstance(spec, str) else load_member(spec, shared))
        except BaseException:
            self.close()
            raise
        _make_names_unique(self.members)
        self.hedge_persist = hedge_persist
        self.hedge_store: WeightStore = hedge_store if hedge_store is not None else MemoryWeights()

    @classmethod
    def holding(cls, members: Sequence[Member], *, hedge_persist: bool = False) -> Ensemble:
        """An ensemble of members loaded elsewhere, none at all included (a server adds and removes
        members as requests need them); closing it closes those it holds then."""
        ensemble = cls.__new__(cls)
        ensemble.members = list(members)
        ensemble.specs = [None] * len(ensemble.members)
        ensemble.hedge_persist = hedge_persist
        ensemble.hedge_store = MemoryWeights()
        return ensemble

    @property
    def hedge_weights(self) -> dict[str, float]:
        """The weights carried to the next query with hedge_persist (empty before the first)."""
        return self.hedge_store.get()

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]

    def steps(self, request: FusionRequest) -> Steps:
        """One generation of `request` as the engine's coroutine: the one way every interface starts one.

        The request's members pick some members by name (None: all). Hedge weights: the request's,
        else, with the ensemble's ``hedge_persist``, those the previous query on the whole ensemble
        ended with (and this one's are kept for the next); a deterministic query neither takes nor
        leaves them (its answer must not depend on earlier ones).
        """
        chosen = self._chosen(request.members)
        options = request.options
        persist = (
            options.hedge
            and self.hedge_persist
            and request.members is None
            and request.weights is None
            and not options.deterministic
        )
        if persist:
            request = replace(request, weights=self.hedge_store.get() or None)
        steps = fusion_steps(chosen, request)
        return self._carrying(steps) if persist else steps

    def pick(self, names: Sequence[str] | None) -> list[Member]:
        """The members named (all of them for None); an unknown name is refused with the list."""
        return self._chosen(names)

    def _chosen(self, names: Sequence[str] | None) -> list[Member]:
        if names is None:
            return list(self.members)
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise InvalidRequestError(f"no member named {unknown[0]!r}", f"members: {', '.join(self.names)}")
        by_name = {m.name: m for m in self.members}
        return [by_name[name] for name in dict.fromkeys(names)]  # in the order named (a server's ensembles')

    def _carrying(self, steps: Steps) -> Steps:
        """`steps`, keeping the Hedge weights it ends with for the next query (in the ensemble's store)."""
        reply = None
        try:
            while True:
                item = steps.send(reply)
                if isinstance(item, DoneEvent):
                    self.hedge_store.put(dict(item.result.weights))
                reply = yield item
        except StopIteration:
            return
        finally:
            steps.close()

    def stream(self, prompt: Conversation | FusionRequest, **options: Any) -> Iterator[Event]:
        """Yield SegmentEvent / RoundEvent as they happen, then a DoneEvent. `options` are
        :func:`request_of`'s keywords: ``weights``, ``constraint``, ``json_schema``, ``json_object``,
        ``top_logprobs``, and ``options=FusionOptions`` or its fields.

        Structured output: ``json_schema={...}`` (the answer validates against it), ``json_object=True``
        (any JSON object), or a ``constraint`` built with :class:`segfuse.constraints.Constraint`.
        ``Result.logprobs()`` gives each answer token's log-probability under its author, with
        `top_logprobs` alternatives. A prompt ``{"role": "raw", "content": text}`` is continued as it
        is, with no chat template (a text completion). A :class:`~segfuse.request.FusionRequest` made
        already is run as it is (it carries its own options).
        """
        return drive(self.steps(request_of(prompt, **options)))

    @property
    def slots(self) -> int:
        """How many generations the members can hold at once (llama.cpp members are loaded with ``slots``)."""
        return min((m.slots or MAX_CONCURRENT for m in self.members), default=1)

    def generate_many(
        self, prompts: Sequence[Conversation | FusionRequest], *, max_concurrent: int | None = None, **options: Any
    ) -> list[Result]:
        """Answer several prompts at once, batching the members' work across them.

        Up to `max_concurrent` (default: every slot the members have; load with
        ``Ensemble(..., slots=N)``) run together; the rest wait their turn.
        Results come in the order of `prompts`; the first failure is raised
        once every prompt has run.
        """
        opts = options.pop("options", None) or FusionOptions.build(**options)
        generations = [self.steps(p if isinstance(p, FusionRequest) else FusionRequest.of(p, opts)) for p in prompts]
        outcomes = run_all(generations, min(max_concurrent or self.slots, self.slots))
        results = [o for o in outcomes if not isinstance(o, BaseException)]
        if len(results) < len(outcomes):
            raise next(o for o in outcomes if isinstance(o, BaseException))
        return results

    def generate(self, prompt: Conversation | FusionRequest, **options: Any) -> Result:
        """Run to completion and return the result with its provenance."""
        for event in self.stream(prompt, **options):
            if isinstance(event, DoneEvent):
                return event.result
        raise RuntimeError("the engine ended without a result")

    def echo(
        self,
        prompt: str | Sequence[int],
        *,
        top_k: int = 0,
        members: Sequence[str] | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> tuple[Member, list[PromptToken]]:
        """Every token of `prompt` with its log-probability from the text's start, as every member (or
        those named) reads it, pooled on the largest member's tokens (``echo.py``); `prompt` may be
        that member's token ids. Returns the member whose tokens these are, and the tokens."""
        return echo_text(self._chosen(members), prompt, top_k=top_k, weights=weights)

    def score(
        self,
        context: str,
        continuations: Sequence[str],
        *,
        rule: str | Rule = "loglinear-byte",
        weights: Mapping[str, float] | None = None,
        members: Sequence[str] | None = None,
    ) -> ItemScores:
        """How likely each continuation of `context` is: every member's summed log-probability, token
        and byte counts and greedy flag per continuation, and their pool under `rule` (``loglinear-byte``,
        ``loglinear-whole``, ``mixture-byte``, ``mixture-whole``; uniform `weights` unless given).

        The context is read as it is (no chat template); its trailing whitespace starts each
        continuation, as lm-eval tokenizes. `members` picks some by name (one: that member alone).
        """
        chosen = rule if isinstance(rule, Rule) else Rule.parse(rule, weights)
        return score_item(self._chosen(members), context, continuations, chosen)

    def score_many(
        self,
        items: Sequence[tuple[str, Sequence[str]]],
        *,
        rule: str | Rule = "loglinear-byte",
        weights: Mapping[str, float] | None = None,
        members: Sequence[str] | None = None,
    ) -> list[ItemScores | Exception]:
        """:meth:`score` for several (context, continuations) items, batched where members hold several
        sessions (``slots``); in order, each item's scores or the error it alone met."""
        chosen = rule if isinstance(rule, Rule) else Rule.parse(rule, weights)
        return score_items(self._chosen(members), items, chosen)

    def close(self) -> None:
        for member in self.members:
            member.close()
        self.members = []

    def __enter__(self) -> Ensemble:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def request_of(
    prompt: Conversation | FusionRequest,
    *,
    weights: Mapping[str, float] | None = None,
    constraint: Constraint | None = None,
    json_schema: Mapping[str, Any] | None = None,
    json_object: bool = False,
    top_logprobs: int = 0,
    **options: Any,
) -> FusionRequest:
    """The request the Python API's keywords make of `prompt` (``options=FusionOptions`` or its fields);
    a request made already is taken as it is, and then no keyword may be given."""
    if isinstance(prompt, FusionRequest):
        keywords = {
            "weights": weights is not None,
            "constraint": constraint is not None,
            "json_schema": json_schema is not None,
            "json_object": json_object,
            "top_logprobs": bool(top_logprobs),
            **dict.fromkeys(options, True),
        }
        given = [name for name, was_given in keywords.items() if was_given]
        if given:
            raise InvalidRequestError(
                f"{given[0]} given with a FusionRequest, which carries its own",
                "make the request with it, or pass the prompt instead",
            )
        return prompt
    opts = options.pop("options", None) or FusionOptions.build(**options)
    return FusionRequest.of(
        prompt,
        opts,
        weights=weights,
        constraint=structured(constraint, json_schema, json_object),
        top_logprobs=top_logprobs,
    )


def structured(
    constraint: Constraint | None, json_schema: Mapping[str, Any] | None, json_object: bool
) -> Constraint | None:
    """One constraint from the Python API's three ways of asking for one."""
    asked = [c for c in (constraint, json_schema, json_object or None) if c is not None]
    if len(asked) > 1:
        raise InvalidRequestError("give one of constraint, json_schema and json_object", "pick one")
    if json_schema is not None:
        return Constraint.json_schema(dict(json_schema), where="json_schema")
    return Constraint.json_object() if json_object else constraint


def _make_names_unique(members: Sequence[Member]) -> None:
    """Two copies of a model must not share a name (results are keyed by it)."""
    seen: dict[str, int] = {}
    for member in members:
        count = seen.get(member.name, 0) + 1
        seen[member.name] = count
        if count > 1:
            member.name = f"{member.name}#{count}"
