"""Models people already have on disk, named the way their tools name them.

=====================  =============================================================
``ollama:NAME[:TAG]``  Ollama's store (``$OLLAMA_MODELS``, ``~/.ollama/models``)
``hf:ORG/REPO``        the Hugging Face hub cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``)
``lmstudio:PUB/REPO``  LM Studio's models folder (``~/.lmstudio/models``)
``llamacache:...``     llama.cpp's download cache (``$LLAMA_CACHE``, ``~/.cache/llama.cpp``)
=====================  =============================================================

Repository names take ``:QUANT`` or ``/FILE.gguf`` to choose among several
GGUF files (see ``choice.py``). Everything is resolved offline from what is
on disk; nothing is ever downloaded. One module per source, each with
``roots()`` (where it looks), ``entries()`` (what it found) and ``find(ref)``.
"""

from __future__ import annotations

from ..errors import ModelFileError, UnknownModelError
from . import hf, llama_cache, lmstudio, ollama
from .entry import Entry, Source
from .gguf_info import read_gguf

SOURCES: dict[str, Source] = {
    ollama.PREFIX: ollama,
    hf.PREFIX: hf,
    lmstudio.PREFIX: lmstudio,
    llama_cache.PREFIX: llama_cache,
}
PREFIXES: tuple[str, ...] = tuple(SOURCES)

__all__ = ["PREFIXES", "SOURCES", "Entry", "Source", "entries", "is_sourced", "locate", "resolve", "suggest"]


def is_sourced(name: str) -> bool:
    """`name` carries a source prefix (``ollama:``, ``hf:``, ...)."""
    prefix, sep, _ = name.partition(":")
    return bool(sep) and prefix in SOURCES


def locate(name: str, *, checkpoint: bool = False) -> Entry:
    """The entry a prefixed name selects, unchecked. Raises UnknownModelError with the closest names."""
    prefix, _, ref = name.partition(":")
    if prefix not in SOURCES:
        raise UnknownModelError(f"unknown model source {prefix!r}", f"known: {', '.join(PREFIXES)}")
    return SOURCES[prefix].find(ref, checkpoint=checkpoint)


def resolve(name: str, *, checkpoint: bool = False) -> Entry:
    """The usable model a prefixed name selects, its files checked like a ``.gguf`` path.

    With `checkpoint`, a Hugging Face checkpoint folder is acceptable (transformers
    members, template sources); otherwise the answer is always a GGUF file.
    """
    entry = locate(name, checkpoint=checkpoint)
    if entry.problem:
        raise ModelFileError(f"{entry.name} cannot be a member: {entry.problem}", entry.hint)
    if entry.path.is_dir():
        return entry  # a checkpoint folder: only found when `checkpoint` allows it
    hint = f"{entry.name}: {entry.hint}"
    infos = [read_gguf(path, hint) for path in entry.files]  # every shard, so a missing one is named
    if infos[0].kind == "mmproj":
        raise ModelFileError(
            f"{entry.path} is a multimodal projector, not a language model", "name the repository's model file instead"
        )
    return entry


def entries() -> list[Entry]:
    """Every model every source found, source by source, by name within a source."""
    return [entry for source in SOURCES.values() for entry in sorted(source.entries(), key=lambda e: e.name.lower())]


def suggest(name: str, limit: int = 3) -> list[str]:
    """Names found on disk that look like `name` (for an unknown bare name such as ``qwen2.5:0.5b``)."""
    import difflib

    found = {e.name.partition(":")[2]: e.name for e in entries() if not e.problem}
    return [found[n] for n in difflib.get_close_matches(name, list(found), n=limit, cutoff=0.6)]
