"""A llama.cpp member's prefix cache on disk (``prefix_cache_dir``): written when asked, read back lazily.

:meth:`DiskPrefixes.save` writes each cached entry with llama.cpp's own sequence state
(``llama_state_seq_get_data``) and its token ids beside it, in the file format of
``prefix_files.py``, under a :class:`~segfuse.backends.prefix_files.Key` made of the model file's
identity (its size and a digest of its first and last MiB), the settings that change what the
cells hold (the window, the cache's types and kernel, the offload), the build (llama-cpp-python's
version and what llama.cpp reports of itself) and a digest of the entries' salt.

Nothing is read at load. The first session whose salt has not been looked up yet lists that
salt's files of this model (headers and tokens only); from then on, a session whose prompt
shares a longer prefix with a file than with any entry in memory reads that file's state into
a free entry (``llama_state_seq_set_data``) and starts from it as from any cached prefix.

llama.cpp writes a sliding-window model's window layers only for the window's last positions,
so such a file serves only matches that reach its end. For those models an entry is also
written at the lengths where the shorter entries it replaced ended (a request's prompt, without
the answer it got) and where entries part (a shared system prompt), as files of their own.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from ...errors import MemberLoadError
from ..prefix_cache import Entry, PrefixCache, common_prefix
from ..prefix_files import DEFAULT_MAX_BYTES, Key, PrefixDir, Stored, Unusable, file_name, salt_digest
from .context import Context, layout
from .runtime import use_extra_buffer_types
from .slots import Slots

log = logging.getLogger("segfuse.backends.prefix_cache")

MIN_GAIN = 32  # tokens a file must add to the longest match in memory to be worth reading
MIN_CHECKPOINT = 64  # the shortest prefix a sliding-window model's extra file is written for
MODEL_SAMPLE = 1 << 20  # bytes of the model file's head and tail its identity digests
AUTO = "auto"


def resolve_dir(value: str | os.PathLike[str]) -> Path:
    """`value` as a directory; ``auto``: ``prefix-cache`` in the user's cache directory."""
    if str(value) == AUTO:
        from platformdirs import user_cache_dir

        return Path(user_cache_dir("segfuse")) / "prefix-cache"
    return Path(value).expanduser()


def model_identity(path: Path) -> str:
    """A digest of the model file: its size and its first and last MiB (the GGUF header and metadata, and
    weights), so a copy or move keeps its files valid and another file or quantization does not."""
    size = path.stat().st_size
    sha = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        sha.update(f.read(MODEL_SAMPLE))
        f.seek(max(0, size - MODEL_SAMPLE))
        sha.update(f.read(MODEL_SAMPLE))
    return sha.hexdigest()


def build() -> str:
    """The llama.cpp build in words: llama-cpp-python's version and llama.cpp's own report of its features."""
    info = lc.llama_print_system_info()
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    return f"llama-cpp-python {lc.__version__}; {' '.join(text.split())}"


def state_per_token(weights: Any) -> int | None:
    """The most bytes one token's cells can take in a sequence's state of the loaded model `weights`, so that a
    file claiming more is refused before it is read; None for a recurrent or hybrid model (its state is not
    per token). Generous: every head's keys and values in f32 (the cache holds f16 by default)."""
    if lc.llama_model_is_recurrent(weights) or lc.llama_model_is_hybrid(weights):
        return None
    n_head = max(1, int(lc.llama_model_n_head(weights)))
    arch = _metadata(weights, "general.architecture")
    dims = [int(v) for kv in ("key", "value") if (v := _metadata(weights, f"{arch}.attention.{kv}_length")).isdigit()]
    head = max([int(lc.llama_model_n_embd(weights)) // n_head, *dims])
    return int(lc.llama_model_n_layer(weights)) * 2 * n_head * head * 4 + 64  # and a cell's position and sequences


def _metadata(weights: Any, key: str) -> str:
    """A GGUF metadata value of the loaded model (empty when it has none)."""
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_model_meta_val_str(weights, key.encode(), buf, len(buf))
    return buf.value.decode(errors="replace") if n >= 0 else ""


def open_disk(
    where: str | os.PathLike[str],
    max_bytes: int | None,
    *,
    model: Path,
    settings: dict[str, Any],
    table: Slots,
    per_token: int | None = None,
) -> DiskPrefixes | None:
    """`table`'s prefix cache kept in the directory `where` (``auto``: the user's cache), within `max_bytes`;
    None when the member keeps no prefix cache. `per_token`: :func:`state_per_token` of the model."""
    if not table.prefix_cache.bound:
        log.info("prefix cache: %s keeps no prefix cache, so nothing goes to %s", table.name, where)
        return None
    directory = PrefixDir(resolve_dir(where), max_bytes or DEFAULT_MAX_BYTES)
    try:
        directory.ensure()
    except OSError as exc:
        raise MemberLoadError(
            f"cannot use {directory.path} as the prefix-cache directory: {exc.strerror or exc}",
            "name a directory this user may write (prefix_cache_dir), or leave it out",
        ) from None
    return DiskPrefixes(directory, model=model, settings=settings, table=table, per_token=per_token)


class DiskPrefixes:
    """One member's prefix-cache entries in `directory`: keyed by `model` (its file) and `settings`.

    The `table`'s context holds the cells and its prefix cache the entries; a free slot's sequence
    is borrowed to copy a shorter prefix into. Call it only from the thread that decodes into that
    context, between decodes. `per_token`: the most bytes one token's state can take (None: unknown).
    """

    def __init__(
        self, directory: PrefixDir, *, model: Path, settings: dict[str, Any], table: Slots, per_token: int | None = None
    ) -> None:
        self.dir, self.model, self.settings, self.per_token = directory, model, settings, per_token
        self.ctx: Context = table.ctx
        self.cache: PrefixCache[int] = table.prefix_cache
        self.swa, self.spare = table.swa, table.spare
        self._model_digest: str | None = None  # read at first use, not at load
        self._build = build()
        self._files: dict[str | None, list[Stored]] = {}  # per salt digest, once listed

    def key(self, salt: str | None) -> Key:
        if self._model_digest is None:
            self._model_digest = model_identity(self.model)
        return Key(self._model_digest, self.settings, self._build, salt_digest(salt))

    def files(self, salt: str | None) -> list[Stored]:
        """This model's files under `salt`, listed at the first call for it."""
        digest = salt_digest(salt)
        if digest not in self._files:
            self._files[digest] = self.dir.find(self.key(salt), self.per_token) if self.dir.path.is_dir() else []
        return self._files[digest]

    # --- reading back ------------------------------------------------------------------
    def read_back(self, prompt: list[int], limit: int, salt: str | None) -> bool:
        """If a file under `salt` shares a longer prefix with `prompt` (at most `limit` tokens) than any entry
        in memory, by at least MIN_GAIN, make it an entry. Call it under the cache's lock; a file that fails
        is ignored (logged), never the session."""
        try:
            found = self._best(prompt, limit, salt)
            return found is not None and self._restore(found, salt)
        except Exception:  # a favour to the session: it reads its prompt as without the directory
            log.exception("prefix cache: reading a prefix back from %s failed", self.dir.path)
            return False

    def _best(self, prompt: list[int], limit: int, salt: str | None) -> Stored | None:
        have = self.cache.peek(prompt, limit, salt)
        wanted = np.asarray(prompt, dtype=np.int64)
        best, length = None, have + MIN_GAIN - 1
        for stored in self.files(salt):
            n = min(common_prefix(stored.tokens, wanted), limit)
            if n > length and n >= stored.floor and len(stored.tokens) <= self.cache.bound:
                best, length = stored, n
        return best

    def _restore(self, stored: Stored, salt: str | None) -> bool:
        try:
            data = self.dir.load(stored)
        except Unusable:
            self._forget(stored, salt)
            return False

        filled = []

        def fill(seq: int, n: int) -> None:
            if not self.ctx.state_set(seq, data, stored.state_at, stored.state_len):
                raise Unusable("llama.cpp could not read its state back")
            filled.append(seq)

        try:
            self.cache.store(stored.tokens.tolist(), fill, salt)
        except Unusable as why:
            self.dir.ignore(stored.path, str(why))
            self._forget(stored, salt)
            return False
        if not filled:  # no room for it
            return False
        self.cache.restored += 1
        log.info("prefix cache: read back %d tokens from %s", len(stored.tokens), stored.path.name)
        return True

    def _forget(self, stored: Stored, salt: str | None) -> None:
        files = self._files.get(salt_digest(salt), [])
        if stored in files:
            files.remove(stored)

    # --- writing -------------------------------------------------------------------------
    def save(self) -> int:
        """Write every entry in memory not on disk yet (and, for a sliding-window model, at its marks),
        then keep the directory within its bound. How many files were written."""
        written = 0
        with self.cache.lock:
            entries = self.cache.snapshot()
            for entry in entries:
                for n in self._lengths(entry, entries):
                    written += self._save_one(entry, n)
        if written:
            self.dir.prune()
            log.info("prefix cache: wrote %d prefixes to %s", written, self.dir.path)
        return written

    def _lengths(self, entry: Entry[int], entries: list[Entry[int]]) -> list[int]:
        """The lengths to write `entry` at: its own; for a sliding-window model also its marks and where
        it parts from other entries under its salt (the longest few)."""
        n = len(entry.tokens)
        if not self.swa:
            return [n]
        parts = {common_prefix(entry.tokens, e.tokens) for e in entries if e is not entry and e.salt == entry.salt}
        extra = {m for m in (*entry.marks, *parts) if MIN_CHECKPOINT <= m < n}
        return [n, *sorted(extra, reverse=True)[:4]]

    def _floor(self, seq: int, n: int) -> int:
        """The shortest match a state of `seq`'s first `n` tokens serves once read back: llama.cpp writes
        the window layers only for the last `swa` positions (and `seq` may hold fewer already)."""
        if not self.swa:
            return 0
        first = max(self.ctx.seq_pos_min(seq), n - self.swa, 0)
        return first + self.swa - 1 if first > 0 else 0

    def _save_one(self, entry: Entry[int], n: int) -> int:
        tokens = entry.tokens[:n]
        key = self.key(entry.salt)
        files = self.files(entry.salt)
        name = file_name(key, tokens)
        known = next((s for s in files if s.path.name == name), None)
        if known is not None and self.dir.touch(known.path):  # on disk already (a regular file)
            return 0
        if n == len(entry.tokens):
            floor, state = self._floor(entry.handle, n), self.ctx.state_get(entry.handle)
        else:
            with self.spare() as seq:
                if seq is None:
                    return 0
                self.ctx.seq_cp(entry.handle, seq, 0, n)
                floor, state = self._floor(seq, n), self.ctx.state_get(seq)
        if floor >= n:  # its window layers lack positions it needs: useless once read back
            return 0
        stored = self.dir.save(key, tokens, state, floor)
        if stored is None:
            return 0
        files[:] = [s for s in files if s.path.name != name]
        self._drop_covered(files, stored)
        files.append(stored)
        self.cache.saved += 1
        return 1

    def _drop_covered(self, files: list[Stored], stored: Stored) -> None:
        """Remove the files `stored` makes useless: shorter prefixes of it (not for a sliding-window model,
        whose shorter files serve matches the longer one cannot)."""
        if self.swa:
            return
        covered = [s for s in files if len(s.tokens) < len(stored.tokens) and _starts(stored.tokens, s.tokens)]
        for s in covered:
            files.remove(s)
            _unlink(s.path)


def _starts(tokens: np.ndarray, prefix: np.ndarray) -> bool:
    return common_prefix(tokens, prefix) == len(prefix)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def settings_of(window: int, gpu_layers: int, params: dict[str, Any]) -> dict[str, Any]:
    """What a member's files are keyed by besides the model and the build: its window, its offload (the GPU's
    kernels compute other numbers), the CPU's weight layouts, and the context's cache types and kernel."""
    offload: dict[str, Any] = {"gpu_layers": gpu_layers}
    if gpu_layers:
        offload.update({k: params.get(k) for k in ("main_gpu", "split_mode", "tensor_split")})
    return {"n_ctx": window, **offload, "extra_bufts": use_extra_buffer_types(), **layout()}
