"""LM Studio's models folder: ``lmstudio:PUBLISHER/REPO``, ``...:QUANT``, ``.../FILE.gguf``.

LM Studio keeps models as ``PUBLISHER/REPO/FILE.gguf`` under its models
folder, found the way LM Studio finds it: its home is the folder named in
``~/.lmstudio-home-pointer`` when that file exists, else ``~/.lmstudio``
(older versions: ``~/.cache/lm-studio``); the models folder is the
``downloadsFolder`` of the home's ``settings.json`` when set (the folder can be
moved in LM Studio's settings), else ``HOME/models``. Which file a folder
name means, when it holds several, is ``choice.py``'s rule.
"""

from __future__ import annotations

import json
from pathlib import Path

from .choice import Repo, display_name, gguf_models, parse_repo_name, pick, shards, short_names
from .entry import Entry, match_name, not_found

PREFIX = "lmstudio"


def _homes() -> list[Path]:
    homes = []
    pointer = Path.home() / ".lmstudio-home-pointer"
    try:
        if pointer.is_file() and pointer.read_text(encoding="utf-8").strip():
            homes.append(Path(pointer.read_text(encoding="utf-8").strip()).expanduser())
    except OSError:
        pass
    return [*homes, Path.home() / ".lmstudio", Path.home() / ".cache" / "lm-studio"]


def roots() -> list[Path]:
    """LM Studio's models folders, the configured one first."""
    found: list[Path] = []
    for home in _homes():
        try:
            folder = json.loads((home / "settings.json").read_text(encoding="utf-8")).get("downloadsFolder")
        except (OSError, ValueError, AttributeError):
            folder = None
        configured = [Path(folder).expanduser()] if isinstance(folder, str) and folder else []
        for candidate in [*configured, home / "models"]:
            if candidate not in found:
                found.append(candidate)
    return found


def _repos() -> dict[str, Repo]:
    """PUBLISHER/REPO -> its GGUF models, from every models folder (the first folder wins a name)."""
    repos: dict[str, Repo] = {}
    for root in roots():
        if not root.is_dir():
            continue
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            repo_id = folder.relative_to(root).as_posix()
            files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
            models = {key: shards(files[key]) for key in gguf_models(files)}
            repos.setdefault(repo_id, Repo(PREFIX, repo_id, models))
    return repos


def _entry(repo: Repo, key: str, name: str) -> Entry:
    files = repo.models[key]
    return Entry(
        PREFIX, name, files[0], display_name(key), files, f"download it again in LM Studio (lms get {repo.repo_id})"
    )


def entries() -> list[Entry]:
    return [_entry(repo, key, name) for repo in _repos().values() for key, name in short_names(repo).items()]


def find(ref: str, *, checkpoint: bool = False) -> Entry:
    """The model `ref` names (without the ``lmstudio:`` prefix)."""
    repo_id, quant, path = parse_repo_name(PREFIX, ref)
    repos = _repos()
    match = match_name(repo_id, list(repos))
    if match is None:
        raise not_found(f"{PREFIX}:{ref}", "LM Studio model", roots(), [f"{PREFIX}:{r}" for r in repos])
    repo = repos[match]
    key = pick(repo, quant, path)  # a folder without GGUF files (an MLX model) is refused here
    return _entry(repo, key, short_names(repo)[key])
