"""Prefix-cache entries on disk, so that a member started again finds the prefixes it had cached.

One file per cached prefix, named for who may use it, ``GROUP-VARIANT-TOKENS.segkv``: GROUP is a
digest of the model's identity and of the entry's salt (a member looks only at its own model's files
under the salt of the session at hand), VARIANT a digest of the format, the settings and the build
that give the cached state its meaning, TOKENS a digest of the token ids. A file is::

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON) | tokens (int32 each) | state

The header holds the format version, the :class:`Key` (a digest of the model, the settings, the build,
a digest of the salt: never the salt itself), the token count, the state's length, the SHA-256 of the
tokens and the state, and the shortest match the state may serve. Nothing is used unchecked: a file
of another key is ignored, one shorter or longer than its header says, whose header is malformed (of
any depth), whose state is larger than the directory's bound or than the model's state can be, or
whose digest differs, is ignored and removed; each with one log line. A file's size is checked before
its body is read. Only regular files are opened or touched: never a symlink's target (it may lie
outside the directory), nor a FIFO or device (opening one may block a request for ever). Writes go to
a temporary file renamed into place, so a reader never sees half a file. The directory is kept within
a bound of bytes, the least recently used files going first (a file's modification time is its last
use: reading or saving it again touches it).

Backend-agnostic: the state is whatever bytes the backend gave (``llama_cpp/persist.py`` makes them).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("segfuse.backends.prefix_cache")

MAGIC = b"SEGFKV\r\n"  # the \r\n shows a file mangled as text
FORMAT = 1
SUFFIX = ".segkv"
TEMP = ".tmp"
MAX_HEADER = 64 << 10  # bytes of JSON header a file may have (ours have under 2 KiB)
MAX_TOKENS = 1 << 24
STATE_OVERHEAD = 1 << 20  # bytes a state may hold besides its cells' (see PrefixDir.find's per_token)
HEADER_ERRORS = (ValueError, KeyError, TypeError, OverflowError, RecursionError)  # a bad header's, any of them
# Open without following a symlink, nor waiting for a FIFO's writer (no effect on a regular file's reads)
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
STALE_TEMP_S = 600.0  # a temporary file this old was left by a write that never finished
DEFAULT_MAX_BYTES = 2 << 30


def digest(*parts: Any) -> str:
    """A hex SHA-256 of `parts` as canonical JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def salt_digest(salt: str | None) -> str | None:
    """What a file keeps of a request's ``cache_salt``: a digest, never the salt (None: no salt)."""
    return None if salt is None else hashlib.sha256(b"segfuse cache_salt\0" + salt.encode()).hexdigest()


@dataclass(frozen=True)
class Key:
    """What a cached state's meaning depends on: a file is used only under an equal key."""

    model: str  # digest of the model file's identity
    settings: Mapping[str, Any]  # the member's settings that change the state (context, cache types, offload)
    build: str  # the backend's build
    salt: str | None = None  # salt_digest of the entries' salt

    @property
    def group(self) -> str:
        return digest("group", self.model, self.salt)[:20]

    @property
    def variant(self) -> str:
        return digest("variant", FORMAT, dict(self.settings), self.build)[:8]

    def as_json(self) -> dict[str, Any]:
        return {"model": self.model, "settings": dict(self.settings), "build": self.build, "salt": self.salt}

    def mismatch(self, other: Any) -> str | None:
        """How a file's key `other` (its header's) differs from this one, in words; None when equal."""
        if not isinstance(other, dict):
            return "its header has no key"
        if other.get("model") != self.model:
            return "it was written for another model"
        if other.get("salt") != self.salt:
            return "it was written under another cache_salt"
        if other.get("build") != self.build:
            return f"it was written by another build ({str(other.get('build'))[:80]!r}; here {self.build[:80]!r})"
        given = other.get("settings")
        theirs: dict[str, Any] = given if isinstance(given, dict) else {}
        changed = [f"{k} {theirs.get(k)!r} (here {v!r})" for k, v in self.settings.items() if theirs.get(k) != v]
        changed += [f"{k} {theirs[k]!r} (here none)" for k in theirs if k not in self.settings]
        return f"it was written with other settings: {', '.join(changed)}" if changed else None


def _fields(raw: bytes) -> tuple[Any, int, int, int, str, Any]:
    """A header's format, token count, state length, floor, digest and key; Unusable for any failure to parse
    it (nesting too deep for the parser, a number too large, a field missing or of another type), so that a
    bad file costs only itself."""
    try:
        header = json.loads(raw)
        fields = header["format"], int(header["tokens"]), int(header["state"]), int(header["floor"])
        return (*fields, str(header["sha256"]), header.get("key"))
    except HEADER_ERRORS:
        raise Unusable("its header is malformed or truncated") from None


def file_name(key: Key, tokens: np.ndarray) -> str:
    return f"{key.group}-{key.variant}-{hashlib.sha256(_token_bytes(tokens)).hexdigest()[:16]}{SUFFIX}"


def _token_bytes(tokens: np.ndarray) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


@dataclass(eq=False)
class Stored:
    """A file's header and tokens, read; its state is read only when it is used (:meth:`PrefixDir.load`)."""

    path: Path
    tokens: np.ndarray
    floor: int  # the shortest match its state may serve
    state_at: int  # offset of the state in the file
    state_len: int
    sha256: str


class Unusable(Exception):
    """A file that must not be used; the message says why. `broken`: no one can ever use it (else it may
    be another setting's, build's or version's)."""

    def __init__(self, why: str, *, broken: bool = True) -> None:
        super().__init__(why)
        self.broken = broken


class PrefixDir:
    """A directory of prefix files within `max_bytes`, shared by any number of members and processes."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(path).expanduser()
        self.max_bytes = max_bytes
        self._told: set[str] = set()  # files already logged as ignored
        self._lock = threading.Lock()

    def ensure(self) -> None:
        """Create the directory, readable by its owner only (the files hold users' prompts)."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)

    # --- reading ------------------------------------------------------------------
    def find(self, key: Key, per_token: int | None = None) -> list[Stored]:
        """Every usable file of `key`'s group: headers and tokens only; the others ignored (logged once), so
        that a bad file costs only itself. `per_token`: the most bytes of state one token's cells can take in
        the model (None: unknown), so that a header's claim is checked before anything is read on it."""
        found = []
        for path in sorted(self.path.glob(f"{key.group}-*{SUFFIX}")):
            if path.name in self._told:
                continue
            try:
                found.append(self._head(path, key, per_token))
            except Unusable as why:
                self.ignore(path, str(why), remove=why.broken)
            except OSError as exc:  # removed meanwhile by another process's pruning, or unreadable
                if path.exists():
                    self.ignore(path, f"it cannot be read ({exc.strerror or exc})")
        return found

    def _head(self, path: Path, key: Key, per_token: int | None) -> Stored:
        with self._open(path) as f:
            size = os.fstat(f.fileno()).st_size
            start = f.read(len(MAGIC) + 4)
            if len(start) < len(MAGIC) + 4 or start[: len(MAGIC)] != MAGIC:
                raise Unusable("it is not a prefix-cache file, or is truncated before its header")
            (n_header,) = struct.unpack("<I", start[len(MAGIC) :])
            if n_header > MAX_HEADER:
                raise Unusable(f"its header is malformed ({n_header} bytes long)")
            version, n, state_len, floor, sha, theirs = _fields(f.read(n_header))
            if version != FORMAT:
                raise Unusable(f"it is of format {version!r} (this segfuse reads {FORMAT})", broken=False)
            why = key.mismatch(theirs)
            if why:
                raise Unusable(why, broken=False)
            if not 0 < n <= MAX_TOKENS or state_len <= 0:
                raise Unusable("its header is malformed")
            state_at = len(start) + n_header + 4 * n
            self._check_size(size, state_at, state_len, n * per_token + STATE_OVERHEAD if per_token else None)
            tokens = np.frombuffer(f.read(4 * n), dtype="<i4").astype(np.int64)
        return Stored(path, tokens, floor, state_at, state_len, sha)

    def _check_size(self, size: int, state_at: int, state_len: int, most_state: int | None) -> None:
        """Refuse a file before its body is read: one whose size is not its header's (a sparse file may claim
        any size), or whose state is over what the model's can be or over the directory's bound."""
        if size != state_at + state_len:
            raise Unusable(f"it is truncated or padded: {size} bytes where its header says {state_at + state_len}")
        if most_state is not None and state_len > most_state:
            raise Unusable(f"its header claims a state of {state_len} bytes, more than this model's can be")
        if size > self.max_bytes:
            raise Unusable(f"it is larger than the directory's bound ({size} bytes; at most {self.max_bytes})")

    def _open(self, path: Path) -> io.FileIO:
        """`path` opened for reading if it is a regular file in the directory: never a symlink's target (it may
        lie outside), nor a FIFO or device (opening or reading one may block a request for ever). Neither
        is ours, so neither is removed. Checked before opening, and on what was opened (it may have been
        swapped meanwhile)."""
        if not stat.S_ISREG(path.lstat().st_mode) or path.resolve().parent != self.path.resolve():
            raise Unusable("it is not a regular file in the directory", broken=False)
        fd = os.open(path, OPEN_FLAGS)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise Unusable("it is not a regular file in the directory", broken=False)
        return os.fdopen(fd, "rb", buffering=0)

    def load(self, stored: Stored) -> bytearray:
        """A file's state, checked against its digest (else it is ignored and removed, and Unusable raised).
        Its size is checked before its body is read into a buffer of that size: a file grown or swapped since
        its header was read costs no memory."""
        try:
            data = self._read(stored.path, stored.state_at + stored.state_len)
        except FileNotFoundError:  # removed by the bound (this process's or another's): nothing to say
            raise Unusable("it is gone", broken=False) from None
        except Unusable as why:
            raise self.ignore(stored.path, str(why), remove=why.broken) from None
        except OSError as exc:
            raise self.ignore(stored.path, f"it cannot be read ({exc.strerror or exc})") from None
        body = memoryview(data)[stored.state_at - 4 * len(stored.tokens) :]
        if hashlib.sha256(body).hexdigest() != stored.sha256:
            raise self.ignore(stored.path, "its checksum does not match (a corrupt or partial write)", remove=True)
        self.touch(stored.path)
        return data

    def _read(self, path: Path, size: int) -> bytearray:
        """The `size` bytes of `path`, if that is its size (else Unusable)."""
        with self._open(path) as f:
            if os.fstat(f.fileno()).st_size != size:
                raise Unusable("it changed since its header was read")
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise Unusable("it changed since its header was read")
                got += n
        return data

    def ignore(self, path: Path, why: str, *, remove: bool = False) -> Unusable:
        """Log once that `path` is not used, and why (removing it where it can never be used); the exception
        to raise."""
        if path.name not in self._told:
            self._told.add(path.name)
            log.warning("prefix cache: ignoring %s: %s%s", path, why, " (removed)" if remove else "")
        if remove:
            with contextlib.suppress(OSError):
                path.unlink()
        return Unusable(why)

    # --- writing ------------------------------------------------------------------
    def save(self, key: Key, tokens: np.ndarray, state: Any, floor: int) -> Stored | None:
        """Write `state` (bytes or a buffer) for `tokens` under `key`, atomically; None when it cannot fit
        the directory's bound or the write fails (logged)."""
        raw = _token_bytes(tokens)
        view = memoryview(state).cast("B")
        n_state = view.nbytes
        checksum = hashlib.sha256(raw)
        checksum.update(view)
        header = json.dumps(
            {
                "format": FORMAT,
                "key": key.as_json(),
                "tokens": len(tokens),
                "state": n_state,
                "floor": floor,
                "sha256": checksum.hexdigest(),
            }
        ).encode()
        start = MAGIC + struct.pack("<I", len(header)) + header
        if len(start) + len(raw) + n_state > self.max_bytes:
            log.warning("prefix cache: a prefix of %d tokens takes more than the directory's bound", len(tokens))
            return None
        path = self.path / file_name(key, tokens)
        try:
            self.ensure()
            fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP, dir=self.path)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(start)
                    f.write(raw)
                    f.write(view)
                os.replace(temp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
        except OSError as exc:
            log.warning("prefix cache: cannot write %s: %s", path, exc.strerror or exc)
            return None
        self._told.discard(path.name)
        return Stored(
            path, np.asarray(tokens, dtype=np.int64), floor, len(start) + len(raw), n_state, checksum.hexdigest()
        )

    @staticmethod
    def touch(path: Path) -> bool:
        """Mark `path` used now (the bound removes the least recently used first), if it is a regular file:
        a symlink's target may lie outside the directory. Whether it was."""
        with contextlib.suppress(OSError):
            if stat.S_ISREG(path.lstat().st_mode):
                os.utime(path, follow_symlinks=False)  # a symlink swapped in meanwhile: its own time
                return True
        return False

    def prune(self, keep: Path | None = None) -> int:
        """Remove the least recently used files (and temporary files left by writes that never finished)
        until the directory holds at most ``max_bytes``; `keep` goes last. How many were removed."""
        with self._lock:
            files, now, removed = [], time.time(), 0
            for path in self.path.glob(f"*{SUFFIX}*"):
                try:
                    seen = path.lstat()
                except OSError:
                    continue
                if not stat.S_ISREG(seen.st_mode):  # not ours (a symlink's target is counted where it lies)
                    continue
                if path.name.endswith(TEMP):
                    if now - seen.st_mtime > STALE_TEMP_S:
                        with contextlib.suppress(OSError):
                            path.unlink()
                    continue
                files.append((path == keep, seen.st_mtime, seen.st_size, path))
            total = sum(f[2] for f in files)
            for _, _, size, path in sorted(files):
                if total <= self.max_bytes:
                    break
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
                total -= size
            return removed
