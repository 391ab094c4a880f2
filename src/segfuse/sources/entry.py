"""What every model source returns: the models it found, and a clear error when a name is not among them."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import UnknownModelError


@dataclass(frozen=True)
class Entry:
    """One model a source offers.

    `path` is a GGUF file (the first shard of a split model) or, for a Hugging
    Face checkpoint without GGUF files, its snapshot directory. `problem` says
    why the model cannot be a member (e.g. an Ollama model with a projector
    layer); such entries are listed but refused by name.
    """

    source: str  # "ollama", "hf", "lmstudio", "llamacache"
    name: str  # what -m takes, prefix included
    path: Path
    label: str  # the member's display name
    files: tuple[Path, ...]  # every file of the model on disk, for its size
    hint: str  # what to do when it cannot be used: how to download it again, or what to use instead
    problem: str | None = None


class Source(Protocol):
    """What each source module provides (ollama.py, hf.py, lmstudio.py, llama_cache.py)."""

    PREFIX: str

    def roots(self) -> list[Path]: ...  # where it looks, for error messages

    def entries(self) -> list[Entry]: ...  # every model it found, for `segfuse models`

    def find(self, ref: str, *, checkpoint: bool = False) -> Entry: ...  # the model `ref` names


def not_found(name: str, what: str, roots: Sequence[Path], known: Sequence[str]) -> UnknownModelError:
    """`name` is not among `known`: say where we looked and which names come closest."""
    where = ", ".join(str(r) for r in roots) or "nowhere (no folder configured)"
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if close:
        found = f"closest: {', '.join(close)}"
    elif known:
        found = f"found {len(known)}: {', '.join(sorted(known)[:5])}{', …' if len(known) > 5 else ''}"
    else:
        found = "found none"
    return UnknownModelError(f"no {what} {name} (looked in {where})", f"{found}; `segfuse models` lists them all")


def match_name(wanted: str, available: Sequence[str]) -> str | None:
    """`wanted` among `available`: exactly, else case-insensitively when that is unambiguous."""
    if wanted in available:
        return wanted
    folded = [a for a in available if a.lower() == wanted.lower()]
    return folded[0] if len(folded) == 1 else None
