"""Member specs -> loaded members. Backends are imported lazily by name.

A member spec is a string: a known model name (``smollm2-135m``), a path to a
GGUF file, or ``KIND:TARGET`` for a named backend (``llama_cpp:/models/x.gguf``).
Registering a backend is one entry in BACKENDS; the engine never changes.

Backends and their targets (``#...`` is optional: a display name and/or
``key=value`` options, comma-separated):

- ``llama_cpp:PATH_OR_NAME`` (the default kind);
- ``transformers:PATH_OR_NAME[#NAME,device=cuda:0,dtype=bf16,n_ctx=N,trust_remote_code=true]``:
  a Hugging Face model directory, or a GGUF file / embedded model dequantized
  by transformers (``segfuse[hf]``);
- ``remote:URL[#NAME,model=M,template=T,format=chat|plain,eos=TEXT,server=KIND,batch=BOOL,
  timeout=S,retries=N,backoff=S,n_ctx=N,check_echo=BOOL]``: a model behind an
  OpenAI-compatible completions server, URL being its ``/v1`` base, e.g.
  ``remote:http://127.0.0.1:8000/v1#qwen72b,template=/models/qwen72b``
  (``segfuse[remote]``; see docs/deploy.md);
- ``ray:SPEC[#NAME,replicas=K,cpus=C,gpus=G,expire_s=S,gather_ms=M,restarts=N,timeout=S,address=A]``:
  K copies of the member SPEC in Ray actors across a cluster (``segfuse[ray]``; see docs/deploy.md).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnknownModelError
from ..extras import require
from ..member_options import MemberOptions
from .base import Member

log = logging.getLogger("segfuse.backends")

BACKENDS: dict[str, str] = {
    "llama_cpp": "segfuse.backends.llama_cpp.member:load",
    "transformers": "segfuse.backends.transformers.member:load",
    "remote": "segfuse.backends.remote.member:load",
    "ray": "segfuse.backends.ray.member:load",
}


@dataclass(frozen=True)
class MemberSpec:
    backend: str
    target: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, **options: Any) -> MemberSpec:
        kind, sep, rest = text.partition(":")
        if sep and kind in BACKENDS:
            return cls(kind, rest, options)
        return cls("llama_cpp", text, options)


# backend -> what says a member's bytes before it loads (backends absent: none to say; remote members take no
# memory here, Ray members take theirs in their actors)
ESTIMATES: dict[str, str] = {
    "llama_cpp": "segfuse.backends.llama_cpp.sizes:estimate",
    "transformers": "segfuse.backends.transformers.sizes:estimate",
}

# backend -> the optional extra it needs (the llama.cpp backend is in the core)
BACKEND_EXTRAS: dict[str, str] = {"transformers": "hf", "remote": "remote", "ray": "ray"}


def _loader(backend: str) -> Callable[..., Member]:
    try:
        module_name, _, attr = BACKENDS[backend].partition(":")
    except KeyError:
        raise UnknownModelError(f"unknown backend {backend!r}", f"known: {', '.join(BACKENDS)}") from None
    if backend in BACKEND_EXTRAS:
        require(BACKEND_EXTRAS[backend], f"{backend}: members")
    loader: Callable[..., Member] = getattr(importlib.import_module(module_name), attr)
    return loader


def load_member(spec: MemberSpec | str, shared: MemberOptions | None = None, **options: Any) -> Member:
    """Load one member under the ensemble's `shared` options (or `options`, validated here); each backend
    takes the shared fields that apply to it and reads its spec's own ``#key=value`` options."""
    if isinstance(spec, str):
        spec = MemberSpec.parse(spec, **options)
    if shared is None:
        shared = MemberOptions.build(spec.options, where=f"member {spec.target!r}")
    return _loader(spec.backend)(spec.target, shared)


def estimate_bytes(spec: MemberSpec | str, shared: MemberOptions | None = None) -> int | None:
    """The bytes ``load_member(spec, shared)`` would take where it runs, said before it loads (None where its
    backend cannot say, or its file cannot be read: the load will say why)."""
    if isinstance(spec, str):
        spec = MemberSpec.parse(spec)
    where = ESTIMATES.get(spec.backend)
    if where is None:
        return None
    module_name, _, attr = where.partition(":")
    try:
        estimate: Callable[..., int | None] = getattr(importlib.import_module(module_name), attr)
        return estimate(spec.target, shared or MemberOptions.build(spec.options, where=f"member {spec.target!r}"))
    except Exception as exc:  # a missing file, a missing extra: no estimate, and the load reports it
        log.debug("no size estimate for %s: %s", spec.target, exc)
        return None
