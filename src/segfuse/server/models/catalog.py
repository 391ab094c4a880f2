"""What a server serves: its models (ensembles) by name, each with its members and defaults.

Pure data, built once from the config: the models come from ``ServerConfig.declared`` (``[server]
model_id`` with ``[members] models``, and ``[ensembles]``); a member spec that two ensembles name is one
member, under one name: its spec's ``#NAME``, else the file or folder it names, else the spec as
written (``smollm2-135m``); the members of an ensemble given loaded keep theirs. Every member is a
model of its own too (a request may name one to have it answer alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath

from ...config import ServerConfig
from ...ensemble import Ensemble
from ...errors import UnknownModelError
from ...keep_alive import FOREVER, keep_alive_seconds
from ...models import DEFAULT_MODELS
from ...options import FusionOptions

BACKEND_PREFIXES = ("llama_cpp:", "transformers:", "ray:")


@dataclass(frozen=True)
class Model:
    """A model a request may name: an ensemble, or one member alone."""

    name: str
    members: tuple[str, ...]  # the members that answer, by name, in order
    defaults: FusionOptions  # the fusion options of requests that do not set them
    ensemble: bool = True  # False: a member alone
    keep_s: float | None = None  # its members' keep-alive ([ensembles.NAME] keep_alive; FOREVER: pinned)


@dataclass
class Catalog:
    """The models, the members they need (name -> spec) and the model of requests that name none."""

    models: dict[str, Model]
    specs: dict[str, str | None]  # member name -> its spec (None: given loaded, cannot be loaded again)
    default: str
    preload: list[str] = field(default_factory=list)  # models loaded at start

    @classmethod
    def of(cls, config: ServerConfig, given: Ensemble | None = None) -> Catalog:
        """The catalog of `config`; `given`: an ensemble loaded already, the default model (its members
        keep their names, and a spec it was loaded from is that member wherever another model names it)."""
        names: dict[str, str] = {}
        specs: dict[str, str | None] = {}
        if given is not None:
            for spec, name in zip(given.specs, given.names, strict=True):
                specs[name] = spec
                if spec is not None:
                    names.setdefault(spec, name)
        models: dict[str, Model] = {}
        for model, declared in config.declared().items():
            defaults = config.ensemble_defaults(model) if model in config.ensembles else config.fusion_defaults()
            if given is not None and model == config.default_model():
                models[model] = Model(model, tuple(given.names), defaults)
                continue
            members = _names_of(declared or list(DEFAULT_MODELS), names, specs)
            section = config.ensembles.get(model)
            keep = None if section is None or section.keep_alive is None else keep_alive_seconds(section.keep_alive)
            models[model] = Model(model, members, defaults, keep_s=keep)
        for name in specs:
            if name not in models:  # an ensemble's name wins over a member's
                models[name] = Model(name, (name,), config.fusion_defaults(), ensemble=False)
        preload = [] if given is not None else config.preloaded()
        return cls(models, specs, config.default_model(), preload)

    def model(self, name: str | None) -> Model:
        """The model a request names (None: the default); UnknownModelError for any other name, with the list
        (a 404)."""
        chosen = self.models.get(name or self.default)
        if chosen is None:
            raise UnknownModelError(
                f"unknown model {name!r}; this server serves {', '.join(self.ensembles)} and the members "
                f"{', '.join(self.specs)}"
            )
        return chosen

    @property
    def ensembles(self) -> list[str]:
        return [m.name for m in self.models.values() if m.ensemble]

    def holders(self, member: str) -> list[str]:
        """The ensembles `member` belongs to."""
        return [m.name for m in self.models.values() if m.ensemble and member in m.members]

    def keep_of(self, member: str) -> float | None:
        """The keep-alive its ensembles give `member`: the longest (FOREVER where one pins it); None: none set."""
        given = [keep for name in self.holders(member) if (keep := self.models[name].keep_s) is not None]
        return max(given, default=None)

    def pinned(self, member: str) -> bool:
        """Whether an ensemble pins `member` (keep_alive -1): once loaded, never freed by expiry nor for room."""
        return self.keep_of(member) == FOREVER

    def single(self) -> bool:
        """Whether the server serves one ensemble (its Hedge weights may carry over between requests)."""
        return len(self.ensembles) == 1


def _names_of(declared: list[str], names: dict[str, str], specs: dict[str, str | None]) -> tuple[str, ...]:
    """The member names of one model's specs: a spec other models name too is the same member, a spec
    named twice in one model is two members (two copies, as an Ensemble of them holds)."""
    members: list[str] = []
    for spec in declared:
        nth = sum(1 for earlier in declared[: len(members)] if earlier == spec)
        key = spec if nth == 0 else f"{spec}\x00{nth}"
        if key not in names:
            base = spec_name(spec)
            name, count = base, 1
            while name in specs:
                count += 1
                name = f"{base}#{count}"
            names[key], specs[name] = name, spec
        members.append(names[key])
    return tuple(members)


def spec_name(spec: str) -> str:
    """A member's name from its spec alone: ``#NAME``, else the file's stem or the folder's name, else the
    model's name as written (``smollm2-135m``, ``hf:org/repo``)."""
    head, _, fragment = spec.partition("#")
    given = [part.strip() for part in fragment.split(",") if part.strip() and "=" not in part]
    if given:
        return given[-1]
    for prefix in BACKEND_PREFIXES:
        if head.startswith(prefix):
            return spec_name(head[len(prefix) :])
    if head.lower().endswith(".gguf"):
        return PurePath(head).stem
    if "/" in head and ":" not in head.split("/")[0]:  # a path (not a URL, not a sourced name)
        return PurePath(head).name
    return head


__all__ = ["Catalog", "Model", "spec_name"]
