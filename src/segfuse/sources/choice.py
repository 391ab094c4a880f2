"""Which GGUF file a repository name means, when a repository holds several.

Shared by ``hf:``, ``lmstudio:`` and ``llamacache:`` names. A repository is a
folder of files; its *models* are its ``.gguf`` files, less multimodal
projectors (``mmproj*``) and the second and later shards of split models
(``-00002-of-00003.gguf``): a split model is named by its first shard.

The rule, for ``ORG/REPO`` (no quantisation given), follows llama.cpp's ``-hf``
default but never guesses past it:

1. a repository with one model: that model;
2. else the one model quantised ``Q4_K_M``;
3. else the one model of another 4-bit quantisation (``Q4_0``, ``Q4_K_S``, ``IQ4_XS``...);
4. else an error listing the choices.

``ORG/REPO:QUANT`` takes the model of that quantisation (case-insensitive) and
``ORG/REPO/PATH.gguf`` the file at that path in the repository.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnknownModelError

_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# Quantisation as it appears in file names: Q4_K_M, IQ3_XXS, Q8_0, UD-Q4_K_XL, F16, BF16, TQ1_0, MXFP4...
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d+(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|MXFP4(?:_MOE)?))(?![A-Za-z0-9])",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Repo:
    """A folder of GGUF models known by one name (a Hugging Face repository, an LM Studio folder)."""

    prefix: str  # the source prefix: "hf", "lmstudio", "llamacache"
    repo_id: str  # ORG/REPO
    models: Mapping[str, tuple[Path, ...]]  # path in the repository -> its files on disk (shards in order)
    tags: Mapping[str, str] = field(default_factory=dict)  # llama.cpp's cached tags -> path in the repository

    def name(self, key: str | None = None, quant: str | None = None) -> str:
        base = f"{self.prefix}:{self.repo_id}"
        return f"{base}/{key}" if key else (f"{base}:{quant}" if quant else base)


def gguf_models(paths: Iterable[str]) -> list[str]:
    """The model files among a repository's paths: GGUF, no projectors, first shards only."""
    found = []
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        if not name.lower().endswith(".gguf") or name.lower().startswith("mmproj"):
            continue
        shard = _SHARD.search(name)
        if shard and int(shard.group(1)) != 1:
            continue
        found.append(path)
    return sorted(found)


def shards(first: Path) -> tuple[Path, ...]:
    """All files of a model, given its first file (one file unless split)."""
    match = _SHARD.search(first.name)
    if not match:
        return (first,)
    total = int(match.group(2))
    stem = first.name[: match.start()]
    return tuple(first.with_name(f"{stem}-{i:05d}-of-{total:05d}.gguf") for i in range(1, total + 1))


def quant_of(path: str) -> str | None:
    """The quantisation a file name declares (the last one in it), upper-cased: "Q4_K_M"."""
    found = _QUANT.findall(path.rsplit("/", 1)[-1])
    return found[-1].upper() if found else None


def display_name(path: str) -> str:
    """A member's display name from its file: the stem, without a split suffix."""
    name = path.rsplit("/", 1)[-1]
    match = _SHARD.search(name)
    if match:
        return name[: match.start()]
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def _listing(repo: Repo) -> str:
    """The choices, by quantisation where that tells them apart, else by path."""
    quants = [quant_of(k) for k in repo.models]
    if None in quants or len(set(quants)) < len(quants):
        return ", ".join(repo.models)
    return ", ".join(sorted(q for q in quants if q))


def pick(repo: Repo, quant: str | None = None, path: str | None = None) -> str:
    """The path (in the repository) of the model a name selects, by the rule above."""
    keys = list(repo.models)
    if path is not None:
        if path in repo.models:
            return path
        raise UnknownModelError(
            f"{repo.name()} has no model file {path!r}", f"its model files: {', '.join(keys) or 'none'}"
        )
    if quant is not None:
        tagged = {t.upper(): k for t, k in repo.tags.items()}
        if quant.upper() in tagged:
            return tagged[quant.upper()]
        matching = [k for k in keys if quant_of(k) == quant.upper()]
        if len(matching) == 1:
            return matching[0]
        if not matching:
            raise UnknownModelError(
                f"{repo.name()} has no {quant} model", f"its quantisations: {_listing(repo) or 'none'}"
            )
        raise UnknownModelError(
            f"{repo.name(quant=quant)} is ambiguous: {', '.join(matching)}",
            f"name one file: {repo.name(key=matching[0])}",
        )
    return _default(repo, keys)


def _default(repo: Repo, keys: list[str]) -> str:
    if "latest" in repo.tags:
        return repo.tags["latest"]
    if len(keys) == 1:
        return keys[0]
    if not keys:
        raise UnknownModelError(
            f"{repo.name()} holds no GGUF model file",
            "segfuse's local members are GGUF files (an MLX or safetensors model is not one)",
        )
    preferred: tuple[Callable[[str], bool], ...] = (lambda q: q == "Q4_K_M", lambda q: q.startswith(("Q4", "IQ4")))
    for wanted in preferred:
        chosen = [k for k in keys if wanted(quant_of(k) or "")]
        if len(chosen) == 1:
            return chosen[0]
        if len(chosen) > 1:
            break
    raise UnknownModelError(
        f"{repo.name()} holds several GGUF models: {_listing(repo)}",
        f"add the quantisation or the file: {repo.name(quant=quant_of(keys[0]) or 'Q8_0')} or {repo.name(key=keys[0])}",
    )


def short_names(repo: Repo) -> dict[str, str]:
    """For each model, the shortest name that selects it: ORG/REPO, ORG/REPO:QUANT or ORG/REPO/PATH."""
    try:
        default = pick(repo)
    except UnknownModelError:
        default = None
    names = {}
    for key in repo.models:
        quant = quant_of(key)
        if key == default:
            names[key] = repo.name()
        elif quant and _picks(repo, quant) == key:
            names[key] = repo.name(quant=quant)
        else:
            names[key] = repo.name(key=key)
    return names


def _picks(repo: Repo, quant: str) -> str | None:
    try:
        return pick(repo, quant=quant)
    except UnknownModelError:
        return None


def parse_repo_name(prefix: str, ref: str) -> tuple[str, str | None, str | None]:
    """Split ``ORG/REPO[:QUANT]`` or ``ORG/REPO/PATH.gguf`` into (repo id, quant, path)."""
    if ref.lower().endswith(".gguf") and ref.count("/") >= 2:
        org, repo, path = ref.split("/", 2)
        return f"{org}/{repo}", None, path
    repo_id, _, quant = ref.partition(":")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")) or (_ and not quant):
        raise UnknownModelError(
            f"bad model name {f'{prefix}:{ref}'!r}",
            f"write {prefix}:ORG/REPO, {prefix}:ORG/REPO:QUANT or {prefix}:ORG/REPO/FILE.gguf",
        )
    return repo_id, quant or None, None
