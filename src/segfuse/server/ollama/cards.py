"""What Ollama's model routes say of the models served: ``/api/tags``, ``/api/ps`` and ``/api/show``.

Every ensemble is a model, and so is each member (a request may name one to have it answer alone), as in
``/v1/models``. What Ollama reads from a model file is told from what the server knows: the members'
bytes and parameters once loaded (0 and "" before a member's first load), each model's window, its
fusion defaults as ``parameters``. A digest is not a file's: it is the SHA-256 of the model's name and
its members' specs, stable while the configuration is.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from datetime import UTC, datetime
from typing import Any

from ...backends.base import Member
from ...keep_alive import FOREVER
from ...options import FusionOptions
from ..models.catalog import Model
from ..models.pool import Place, Pool
from ..models.view import context_length

FOREVER_NS = 2**63 - 1  # Ollama's keep_alive -1: the longest Go duration, so ps says the year 2318
GPU_LAYERS = re.compile(r"GPU: (\d+)/(\d+) layers")
PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "num_predict", "seed": "seed"}


def rfc3339(seconds: float) -> str:
    """Unix seconds as Ollama writes a time (Go's RFC 3339, UTC)."""
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _digest(pool: Pool, model: Model) -> str:
    specs = [pool.catalog.specs.get(name) or name for name in model.members]
    return hashlib.sha256("\0".join([model.name, *specs]).encode()).hexdigest()


def _parameter_size(count: int | None) -> str:
    """A parameter count as Ollama shows one ("135M", "1.5B"); "" when unknown."""
    if not count:
        return ""
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"


def _details(model: Model, members: list[Member | None]) -> dict[str, Any]:
    known = [m for m in members if m is not None]
    params = sum(m.n_params or 0 for m in known) if len(known) == len(members) else None
    paths = [str(getattr(m, "path", "")) for m in known]
    gguf = bool(paths) and len(known) == len(members) and all(p.endswith(".gguf") for p in paths)
    return {
        "parent_model": "",
        "format": "gguf" if gguf else "",
        "family": "segfuse" if model.ensemble else "",
        "families": list(model.members) if model.ensemble else None,
        "parameter_size": _parameter_size(params),
        "quantization_level": "",
    }


def _places(pool: Pool) -> dict[str, Place]:
    return {p.name: p for p in pool.snapshot()}


def _card(pool: Pool, model: Model, places: dict[str, Place], started: int) -> dict[str, Any]:
    members = [places[n].member if n in places else None for n in model.members]
    return {
        "name": model.name,
        "model": model.name,
        "modified_at": rfc3339(started),
        "size": sum(places[n].nbytes or 0 for n in model.members if n in places),
        "digest": _digest(pool, model),
        "details": _details(model, members),
    }


def tags(pool: Pool, started: int) -> dict[str, Any]:
    """``GET /api/tags``: every model served, ensembles first; `started`: when the server started."""
    places = _places(pool)
    return {"models": [_card(pool, m, places, started) for m in pool.catalog.models.values()]}


def _expires(places: list[Place], now: float) -> str:
    """When the first of a model's members will be freed, as Ollama writes it; in use: after the keep-alive
    its last request gave; kept: Ollama's forever."""
    mono, soonest = time.monotonic(), math.inf
    for place in places:
        at = place.expires_at()
        if at is None and place.owned and place.keep_s != FOREVER:
            at = mono + place.keep_s  # in use: freed that long after its last request lets it go
        soonest = min(soonest, math.inf if at is None else at)
    if soonest == math.inf:
        return rfc3339(now + FOREVER_NS / 1e9)
    return rfc3339(now + max(0.0, soonest - mono))


def _vram(place: Place) -> int:
    """The bytes of a member's weights on a GPU: its share of offloaded layers (0 on the CPU)."""
    found = GPU_LAYERS.search(place.member.placement or "") if place.member is not None else None
    if found is None or not place.nbytes or not int(found.group(2)):
        return 0
    return place.nbytes * int(found.group(1)) // int(found.group(2))


def ps(pool: Pool, started: int) -> dict[str, Any]:
    """``GET /api/ps``: the models whose members are all loaded (an ensemble's size counts its members,
    which are listed too: a member two ensembles share is loaded once)."""
    places, now = _places(pool), time.time()
    contexts = {m.name: getattr(m, "n_ctx", None) for m in pool.loaded()}
    running = []
    for model in pool.catalog.models.values():
        held = [places[n] for n in model.members if n in places]
        if len(held) != len(model.members) or any(p.state != "loaded" for p in held):
            continue
        card = _card(pool, model, places, started)
        del card["modified_at"]
        card |= {
            "expires_at": _expires(held, now),
            "size_vram": sum(_vram(p) for p in held),
            "context_length": context_length(pool, model.name, contexts),
        }
        running.append(card)
    return {"models": running}


def _parameters(defaults: FusionOptions) -> str:
    """A model's fusion defaults as a Modelfile's PARAMETER lines under Ollama's names."""
    values = defaults.model_dump()
    lines = [f"{theirs} {values[ours]}" for ours, theirs in PARAMETERS.items() if values.get(ours) is not None]
    return "\n".join(lines + [f'stop "{stop}"' for stop in values.get("stop") or []])


def _template(member: Member) -> str | None:
    """A member's chat template, where its backend tells it (llama.cpp's from the GGUF file)."""
    vocab = getattr(member, "vocab", None)
    return getattr(member, "chat_template", None) or getattr(vocab, "chat_template", None)


def show(pool: Pool, model: Model, started: int) -> dict[str, Any]:
    """``POST /api/show``: a model's details, its defaults as ``parameters``, and a member's chat template
    (an ensemble's members each read their own: none is the ensemble's)."""
    places = _places(pool)
    card = _card(pool, model, places, started)
    members = [places[n].member if n in places else None for n in model.members]
    window = context_length(pool, model.name, {m.name: getattr(m, "n_ctx", None) for m in pool.loaded()})
    info: dict[str, Any] = {"general.architecture": "segfuse", "segfuse.members": list(model.members)}
    if all(m is not None for m in members):
        info["general.parameter_count"] = sum(m.n_params or 0 for m in members if m is not None)
    if window is not None:
        info["segfuse.context_length"] = window  # read by clients as "{architecture}.context_length"
    template = None if model.ensemble or members[0] is None else _template(members[0])
    lines = [f"# {'ensemble' if model.ensemble else 'member'} {model.name}: {', '.join(model.members)}"]
    parameters = _parameters(model.defaults)
    return {
        "modelfile": "\n".join(lines + [f"PARAMETER {p}" for p in parameters.splitlines()]),
        "parameters": parameters,
        "template": template or "",
        "details": card["details"],
        "model_info": info,
        "capabilities": ["completion", "tools"],
        "modified_at": card["modified_at"],
    }


__all__ = ["ps", "rfc3339", "show", "tags"]
