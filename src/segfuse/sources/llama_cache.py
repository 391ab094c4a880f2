"""llama.cpp's download cache: ``llamacache:ORG/REPO[:TAG]``, ``llamacache:ORG/REPO/FILE.gguf``,
``llamacache:FILE.gguf``.

Names are what ``llama-server -hf ORG/REPO[:TAG]`` took (and what ``--cache-list`` shows).
The cache is ``$LLAMA_CACHE``, else ``$XDG_CACHE_HOME/llama.cpp`` or
``~/.cache/llama.cpp`` (``~/Library/Caches/llama.cpp`` on macOS,
``%LOCALAPPDATA%\\llama.cpp`` on Windows). It comes in two layouts:

- since 2026, the Hugging Face hub layout (``models--ORG--REPO/snapshots/...``),
  read like ``hf:``. Without ``$LLAMA_CACHE`` that llama.cpp writes straight into
  the Hugging Face cache, so its downloads are ``hf:`` names;
- before, flat files: ``manifest=ORG=REPO=TAG.json`` records which file the tag
  chose (``{"ggufFile": {"rfilename": ...}}``) and the file is stored as
  ``ORG_REPO_FILE`` (every ``/`` made ``_``). Tag ``latest`` is the bare
  ``ORG/REPO``. Other ``.gguf`` files there (``-mu URL`` downloads) are named by
  their file name.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import hf
from .choice import Repo, display_name, gguf_models, parse_repo_name, pick, shards, short_names
from .entry import Entry, match_name, not_found

PREFIX = "llamacache"


def roots() -> list[Path]:
    if os.environ.get("LLAMA_CACHE"):
        return [Path(os.environ["LLAMA_CACHE"]).expanduser()]
    if sys.platform == "darwin":
        return [Path.home() / "Library" / "Caches" / "llama.cpp"]
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return [Path(os.environ["LOCALAPPDATA"]) / "llama.cpp"]
    return [Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "llama.cpp"]


def _flat_repos(root: Path) -> dict[str, Repo]:
    """The old flat layout's repositories, from its manifest files."""
    tags: dict[str, dict[str, str]] = {}
    for manifest in sorted(root.glob("manifest=*=*=*.json")):
        parts = manifest.name[: -len(".json")].split("=")
        if len(parts) != 4:
            continue
        try:
            rfilename = json.loads(manifest.read_text(encoding="utf-8"))["ggufFile"]["rfilename"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(rfilename, str) and rfilename:
            tags.setdefault(f"{parts[1]}/{parts[2]}", {})[parts[3]] = rfilename
    repos = {}
    for repo_id, by_tag in tags.items():
        models = {key: shards(_stored(root, repo_id, key)) for key in gguf_models(set(by_tag.values()))}
        repos[repo_id] = Repo(PREFIX, repo_id, models, tags={t: k for t, k in by_tag.items() if k in models})
    return repos


def _stored(root: Path, repo_id: str, key: str) -> Path:
    """Where the flat layout keeps a repository's file: ORG_REPO_FILE, every "/" made "_" (llama.cpp's naming)."""
    return root / f"{repo_id}_{key}".replace("/", "_")


def _loose_files(root: Path, repos: dict[str, Repo]) -> list[Path]:
    """Flat .gguf files that no manifest claims."""
    claimed = {path for repo in repos.values() for files in repo.models.values() for path in files}
    names = gguf_models(p.name for p in root.glob("*.gguf") if p.is_file())
    return [root / n for n in names if root / n not in claimed]


def _scan() -> tuple[dict[str, Repo], dict[str, hf.Snapshot], dict[str, Path]]:
    root = roots()[0]
    if not root.is_dir():
        return {}, {}, {}
    flat = _flat_repos(root)
    snapshots = hf.scan(root) if any(root.glob("models--*")) else {}
    return flat, snapshots, {p.name: p for p in _loose_files(root, flat)}


def _entry(repo: Repo, key: str, name: str) -> Entry:
    files = repo.models[key]
    tag = next((t for t, k in repo.tags.items() if k == key), "latest")
    hint = f"download it again: llama-server -hf {repo.repo_id}" + ("" if tag == "latest" else f":{tag}")
    return Entry(PREFIX, name, files[0], display_name(key), files, hint)


def _loose_entry(path: Path) -> Entry:
    return Entry(
        PREFIX, f"{PREFIX}:{path.name}", path, display_name(path.name), shards(path), "download it again with llama.cpp"
    )


def entries() -> list[Entry]:
    flat, snapshots, loose = _scan()
    found = [e for s in snapshots.values() for e in hf.repo_entries(PREFIX, s)]
    found += [
        _entry(r, key, name)
        for r in flat.values()
        if r.repo_id not in snapshots
        for key, name in short_names(r).items()
    ]
    return found + [_loose_entry(p) for p in loose.values()]


def find(ref: str, *, checkpoint: bool = False) -> Entry:
    """The model `ref` names (without the ``llamacache:`` prefix)."""
    flat, snapshots, loose = _scan()
    if "/" not in ref and ref.lower().endswith(".gguf"):
        match = match_name(ref, list(loose))
        if match is None:
            raise not_found(f"{PREFIX}:{ref}", "llama.cpp cache file", roots(), [f"{PREFIX}:{n}" for n in loose])
        return _loose_entry(loose[match])
    repo_id, quant, path = parse_repo_name(PREFIX, ref)
    if match_name(repo_id, list(snapshots)) is not None:
        return hf.find_in(PREFIX, ref, roots(), snapshots, "llama.cpp cache model", checkpoint)
    match = match_name(repo_id, list(flat))
    if match is None:
        known = [f"{PREFIX}:{r}" for r in [*snapshots, *flat]] + [f"{PREFIX}:{n}" for n in loose]
        raise not_found(f"{PREFIX}:{ref}", "llama.cpp cache model", roots(), known)
    repo = flat[match]
    key = pick(repo, quant, path)
    return _entry(repo, key, short_names(repo)[key])
