"""Ollama's model store: ``ollama:NAME[:TAG]``.

Names are written as Ollama writes them: ``qwen2.5:0.5b`` (a library model),
``user/model:tag``, ``host/namespace/model:tag`` (e.g. ``hf.co/ORG/REPO:Q4_K_M``);
the tag defaults to ``latest``.

The store is ``$OLLAMA_MODELS``, else ``~/.ollama/models`` (and, on Linux,
``/usr/share/ollama/.ollama/models``, where the system service keeps it). A
model is a manifest, ``manifests/HOST/NAMESPACE/MODEL/TAG``: JSON whose
``layers`` each name a blob by digest (``sha256:HEX`` -> ``blobs/sha256-HEX``).
The layer of media type ``application/vnd.ollama.image.model`` is the GGUF
file. Ollama's own template, system prompt and parameters layers are not used:
the chat template comes from the GGUF itself, as for any GGUF member.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

from ..errors import UnknownModelError
from .entry import Entry, match_name, not_found

PREFIX = "ollama"
MODEL = "application/vnd.ollama.image.model"
_REFUSED = (  # layer media type prefix -> why a model with such a layer is not one GGUF file
    (
        "application/vnd.ollama.image.tensor",
        "it was imported from safetensors: its weights are tensor layers, not one GGUF file",
        "use the original checkpoint with transformers:, or a GGUF build of it",
    ),
    (
        "application/vnd.ollama.image.projector",
        "it has a separate projector layer (a vision model), and a member is one GGUF file",
        "choose a text-only model",
    ),
    (
        "application/vnd.ollama.image.adapter",
        "it has a LoRA adapter layer, and a member is one GGUF file without adapters",
        "choose the model without its adapter",
    ),
)
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
DEFAULT_HOST, DEFAULT_NAMESPACE = "registry.ollama.ai", "library"


def roots() -> list[Path]:
    """Where Ollama keeps models: $OLLAMA_MODELS, else its default folders."""
    env = os.environ.get("OLLAMA_MODELS")
    if env:
        return [Path(env).expanduser()]
    found = [Path.home() / ".ollama" / "models"]
    if sys.platform.startswith("linux"):
        found.append(Path("/usr/share/ollama/.ollama/models"))
    return found


def canonical(ref: str) -> tuple[str, str, str, str]:
    """``[host/][namespace/]model[:tag]`` -> (host, namespace, model, tag), defaults filled in."""
    path, tag = ref, "latest"
    if ":" in ref.rsplit("/", 1)[-1]:
        path, _, tag = ref.rpartition(":")
    parts = path.split("/")
    if not all(parts) or not tag or len(parts) > 3:
        raise UnknownModelError(f"bad Ollama model name {ref!r}", "write ollama:MODEL[:TAG], e.g. ollama:qwen2.5:0.5b")
    if len(parts) == 1:
        return DEFAULT_HOST, DEFAULT_NAMESPACE, parts[0], tag
    if len(parts) == 2:
        return DEFAULT_HOST, parts[0], parts[1], tag
    return parts[0], parts[1], parts[2], tag


def short(host: str, namespace: str, model: str, tag: str) -> str:
    """The name as `ollama list` shows it: default host and namespace left out."""
    if host != DEFAULT_HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == DEFAULT_NAMESPACE else f"{namespace}/{model}:{tag}"


def _blob(root: Path, digest: object) -> Path | None:
    match = _DIGEST.fullmatch(str(digest))
    if not match:
        return None  # never build a path from an unexpected digest
    path = root / "blobs" / f"sha256-{match.group(1)}"
    legacy = root / "blobs" / f"sha256:{match.group(1)}"  # stores written by early Ollama versions
    return legacy if not path.exists() and legacy.exists() else path


def _entry(root: Path, manifest: Path) -> Entry:
    host, namespace, model, tag = manifest.relative_to(root / "manifests").parts
    label = short(host, namespace, model, tag)
    entry = Entry(PREFIX, f"{PREFIX}:{label}", manifest, label, (), f"download it again: ollama pull {label}")
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        media = [str(layer.get("mediaType", "")) for layer in layers]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return _refuse(entry, f"its manifest {manifest} is unreadable", entry.hint)
    for prefix, reason, hint in _REFUSED:
        if any(m.startswith(prefix) for m in media):
            return _refuse(entry, reason, hint)
    models = [layer for layer in layers if layer.get("mediaType") == MODEL]
    if len(models) != 1:
        return _refuse(
            entry,
            f"it has {len(models) or 'no'} model layer{'s' if len(models) != 1 else ''}, not one GGUF file",
            entry.hint,
        )
    blob = _blob(root, models[0].get("digest"))
    if blob is None:
        return _refuse(entry, f"its model layer's digest {models[0].get('digest')!r} is malformed", entry.hint)
    return replace(entry, path=blob, files=(blob,))


def _refuse(entry: Entry, reason: str, hint: str) -> Entry:
    return replace(entry, hint=hint, problem=reason)


def entries() -> list[Entry]:
    """Every model in every store, first store first; a name found twice keeps its first."""
    found: dict[str, Entry] = {}
    for root in roots():
        manifests = root / "manifests"
        if not manifests.is_dir():
            continue
        for manifest in sorted(p for p in manifests.glob("*/*/*/*") if p.is_file()):
            entry = _entry(root, manifest)
            found.setdefault(entry.name, entry)
    return list(found.values())


def find(ref: str, *, checkpoint: bool = False) -> Entry:
    """The model `ref` names (without the ``ollama:`` prefix)."""
    name = f"{PREFIX}:{short(*canonical(ref))}"
    known = {e.name: e for e in entries()}
    match = match_name(name, list(known))
    if match is None:
        raise not_found(name, "Ollama model", roots(), list(known))
    return known[match]
