"""The Hugging Face hub cache: ``hf:ORG/REPO``, ``hf:ORG/REPO:QUANT``, ``hf:ORG/REPO/FILE.gguf``.

The cache is read with ``huggingface_hub.scan_cache_dir`` (never downloaded
into). Its folder is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``, looked up
on every call (huggingface_hub fixes its own default when first imported).
Of a repository's cached revisions, the one ``refs/main`` points to is used,
else the newest. Which GGUF file a repository name means is ``choice.py``'s
rule. A repository without GGUF files is a transformers checkpoint:
``transformers:hf:ORG/REPO`` loads its snapshot folder, and ``template=hf:ORG/REPO``
reads its tokenizer files.

llama.cpp's own cache (``$LLAMA_CACHE``) has had this layout since 2026; its
source reuses ``scan`` and ``repo_entries`` with its own prefix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFileError
from .choice import Repo, display_name, gguf_models, parse_repo_name, pick, shards, short_names
from .entry import Entry, match_name, not_found

PREFIX = "hf"


@dataclass(frozen=True)
class Snapshot:
    """The revision of a cached repository that segfuse reads."""

    repo_id: str
    path: Path  # snapshots/<commit>
    files: dict[str, Path]  # path in the repository -> file in the snapshot
    size: int  # bytes on disk of this revision


def roots() -> list[Path]:
    """The hub cache folder, from the same variables huggingface_hub reads."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return [Path(os.environ[var]).expanduser()]
    if os.environ.get("HF_HOME"):
        return [Path(os.environ["HF_HOME"]).expanduser() / "hub"]
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return [Path(cache).expanduser() / "huggingface" / "hub"]


def scan(root: Path) -> dict[str, Snapshot]:
    """Cached model repositories by id; damaged cache entries are skipped (huggingface_hub reports them)."""
    if not root.is_dir():
        return {}
    from huggingface_hub import scan_cache_dir

    found = {}
    for repo in scan_cache_dir(root).repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        main = [r for r in repo.revisions if "main" in r.refs]
        revision = main[0] if main else max(repo.revisions, key=lambda r: r.last_modified)
        files = {f.file_path.relative_to(revision.snapshot_path).as_posix(): f.file_path for f in revision.files}
        found[repo.repo_id] = Snapshot(repo.repo_id, revision.snapshot_path, files, revision.size_on_disk)
    return found


def as_repo(prefix: str, snapshot: Snapshot) -> Repo:
    models = {key: shards(snapshot.files[key]) for key in gguf_models(snapshot.files)}
    return Repo(prefix, snapshot.repo_id, models)


def repo_entries(prefix: str, snapshot: Snapshot) -> list[Entry]:
    """One entry per GGUF model of a cached repository, each under the shortest name that selects it."""
    repo = as_repo(prefix, snapshot)
    return [_gguf_entry(repo, key, name) for key, name in short_names(repo).items()]


def _gguf_entry(repo: Repo, key: str, name: str) -> Entry:
    files = repo.models[key]
    hint = f"download it again: hf download {repo.repo_id} {key}"
    return Entry(repo.prefix, name, files[0], display_name(key), files, hint)


def is_causal_lm(snapshot: Snapshot) -> bool:
    """A transformers checkpoint of a text generator (what a transformers: member loads)."""
    config = snapshot.files.get("config.json")
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") if config else None
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(a).endswith("ForCausalLM") for a in architectures or ())


def _checkpoint_entry(snapshot: Snapshot) -> Entry:
    return Entry(
        PREFIX,
        f"transformers:{PREFIX}:{snapshot.repo_id}",
        snapshot.path,
        snapshot.repo_id.rsplit("/", 1)[-1],
        tuple(snapshot.files.values()),
        f"download it again: hf download {snapshot.repo_id}",
    )


def entries() -> list[Entry]:
    """Every GGUF model in the cache, and every causal-LM checkpoint (as a transformers: member)."""
    found = []
    for snapshot in scan(roots()[0]).values():
        ggufs = repo_entries(PREFIX, snapshot)
        found.extend(ggufs or ([_checkpoint_entry(snapshot)] if is_causal_lm(snapshot) else []))
    return found


def find_in(
    prefix: str, ref: str, roots_: list[Path], snapshots: dict[str, Snapshot], what: str, checkpoint: bool = False
) -> Entry:
    """`ref` (ORG/REPO[:QUANT] or ORG/REPO/FILE.gguf) among `snapshots`."""
    repo_id, quant, path = parse_repo_name(prefix, ref)
    match = match_name(repo_id, list(snapshots))
    if match is None:
        raise not_found(f"{prefix}:{ref}", what, roots_, [f"{prefix}:{r}" for r in snapshots])
    snapshot = snapshots[match]
    repo = as_repo(prefix, snapshot)
    if not repo.models and quant is None and path is None:
        if checkpoint:
            return _checkpoint_entry(snapshot)
        raise ModelFileError(
            f"{prefix}:{match} holds no GGUF file (a transformers checkpoint?)",
            f"load it with -m transformers:{prefix}:{match} (pip install 'segfuse[hf]')",
        )
    if checkpoint and quant is None and path is None and "config.json" in snapshot.files:
        return _checkpoint_entry(snapshot)  # transformers loads the checkpoint itself, not a dequantised GGUF
    key = pick(repo, quant, path)
    return _gguf_entry(repo, key, short_names(repo)[key])


def find(ref: str, *, checkpoint: bool = False) -> Entry:
    """The model `ref` names (without the ``hf:`` prefix). With `checkpoint`, a repository's
    snapshot folder may be the answer (for transformers: members and template sources)."""
    root = roots()[0]
    return find_in(PREFIX, ref, [root], scan(root), "Hugging Face model", checkpoint)
