"""Member specs -> loaded members. Backends are imported lazily by name.

A member spec is a string: a known model name (``smollm2-135m``), a path to a
GGUF file, or ``KIND:TARGET`` for a named backend (``llama_cpp:/models/x.gguf``).
Registering a backend is one entry in BACKENDS; the engine never changes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnknownModelError
from .base import Member

BACKENDS: dict[str, str] = {
    "llama_cpp": "specfuse.backends.llama_cpp:load",
}


@dataclass(frozen=True)
class MemberSpec:
    backend: str
    target: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, **options: Any) -> "MemberSpec":
        kind, sep, rest = text.partition(":")
        if sep and kind in BACKENDS:
            return cls(kind, rest, options)
        return cls("llama_cpp", text, options)


def _loader(backend: str) -> Callable[..., Member]:
    try:
        module_name, _, attr = BACKENDS[backend].partition(":")
    except KeyError:
        raise UnknownModelError(f"unknown backend {backend!r}", f"known: {', '.join(BACKENDS)}") from None
    return getattr(importlib.import_module(module_name), attr)


def load_member(spec: MemberSpec | str, **options: Any) -> Member:
    if isinstance(spec, str):
        spec = MemberSpec.parse(spec, **options)
    return _loader(spec.backend)(spec.target, **spec.options)
