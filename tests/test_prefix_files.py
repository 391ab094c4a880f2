"""The prefix cache's files (pure logic): what is written, what is checked before use, what is ignored and
removed, and the directory's bound.

The llama.cpp states in them are tested on the real members in test_prefix_cache_disk_real_models.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest

from segfuse.backends.prefix_files import MAGIC, SUFFIX, TEMP, Key, PrefixDir, Unusable, file_name, salt_digest

KEY = Key("model-a", {"n_ctx": 4096, "type_k": 1}, "build 1")
TOKENS = np.arange(100, 160)
STATE = os.urandom(4096)


@pytest.fixture()
def store(tmp_path):
    return PrefixDir(tmp_path / "cache", max_bytes=1 << 20)


def ignored(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "prefix cache: ignoring" in r.getMessage()]


def test_a_saved_state_is_found_by_its_key_and_read_back_whole(store):
    saved = store.save(KEY, TOKENS, STATE, floor=3)
    assert saved is not None and saved.path.name == file_name(KEY, TOKENS)
    assert oct(saved.path.stat().st_mode & 0o777) == "0o600"  # users' prompts: the owner's only
    assert oct(store.path.stat().st_mode & 0o777) == "0o700"
    (found,) = store.find(KEY)
    assert list(found.tokens) == list(TOKENS) and found.floor == 3
    data = store.load(found)
    assert bytes(data[found.state_at : found.state_at + found.state_len]) == STATE


def test_other_salts_and_models_are_other_groups(store):
    store.save(KEY, TOKENS, STATE, floor=0)
    salted = Key(KEY.model, KEY.settings, KEY.build, salt_digest("tenant-a"))
    assert store.find(salted) == []  # another salt's files are not even opened
    assert store.find(Key("model-b", KEY.settings, KEY.build)) == []
    assert salt_digest("tenant-a") != salt_digest("tenant-b") and "tenant-a" not in salted.group


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (Key(KEY.model, {"n_ctx": 2048, "type_k": 1}, KEY.build), "other settings: n_ctx 2048 (here 4096)"),
        (Key(KEY.model, KEY.settings, "build 2"), "another build"),
    ],
)
def test_a_file_of_other_settings_or_build_is_ignored_once_and_kept(store, caplog, other, why):
    saved = store.save(other, TOKENS, STATE, floor=0)
    with caplog.at_level(logging.WARNING):
        assert store.find(KEY) == []
        assert store.find(KEY) == []
    assert len(ignored(caplog)) == 1 and why in ignored(caplog)[0]
    assert saved.path.exists()  # it may be another member's, or another version's


def test_a_file_copied_under_another_models_name_is_ignored(store, caplog):
    saved = store.save(Key("model-b", KEY.settings, KEY.build), TOKENS, STATE, floor=0)
    os.replace(saved.path, store.path / file_name(KEY, TOKENS))
    with caplog.at_level(logging.WARNING):
        assert store.find(KEY) == []
    assert "written for another model" in ignored(caplog)[0]


def test_a_truncated_file_is_ignored_and_removed(store, caplog):
    saved = store.save(KEY, TOKENS, STATE, floor=0)
    with saved.path.open("r+b") as f:
        f.truncate(saved.path.stat().st_size - 100)
    with caplog.at_level(logging.WARNING):
        assert store.find(KEY) == []
    assert "truncated" in ignored(caplog)[0] and not saved.path.exists()


def test_a_corrupt_state_is_caught_by_its_checksum_when_read(store, caplog):
    saved = store.save(KEY, TOKENS, STATE, floor=0)
    with saved.path.open("r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\0" * 10)
    (found,) = store.find(KEY)  # the header is fine: the state is checked when it is used
    with caplog.at_level(logging.WARNING), pytest.raises(Exception, match="checksum"):
        store.load(found)
    assert "checksum does not match" in ignored(caplog)[0] and not saved.path.exists()


def test_garbage_under_a_prefix_files_name_is_ignored_and_removed(store, caplog):
    store.ensure()
    path = store.path / file_name(KEY, TOKENS)
    path.write_bytes(b"not a cache file at all")
    with caplog.at_level(logging.WARNING):
        assert store.find(KEY) == []
    assert "not a prefix-cache file" in ignored(caplog)[0] and not path.exists()


def test_a_failed_write_leaves_no_file_under_its_name_nor_a_temporary_one(store, monkeypatch, caplog):
    import segfuse.backends.prefix_files as files

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full_disk)
    with caplog.at_level(logging.WARNING):
        assert store.save(KEY, TOKENS, STATE, floor=0) is None
    assert not list(store.path.glob(f"*{SUFFIX}*"))
    assert any("No space left" in r.getMessage() for r in caplog.records)


def test_the_least_recently_used_files_go_first_within_the_bound(store):
    store.max_bytes = 3 * (len(STATE) + 1024)
    paths = []
    for k in range(3):
        paths.append(store.save(KEY, TOKENS + k, STATE, floor=0).path)
        os.utime(paths[-1], (time.time() - 100 + k, time.time() - 100 + k))
    store.touch(paths[0])  # read back: now the most recently used
    fourth = store.save(KEY, TOKENS + 3, STATE, floor=0).path
    assert store.prune() == 1
    assert not paths[1].exists() and paths[0].exists() and paths[2].exists() and fourth.exists()
    sizes = sum(p.stat().st_size for p in store.path.glob(f"*{SUFFIX}"))
    assert sizes <= store.max_bytes


def test_a_state_larger_than_the_bound_is_not_written_and_stale_temporary_files_go(store):
    store.max_bytes = 1024
    assert store.save(KEY, TOKENS, STATE, floor=0) is None
    store.ensure()
    stale = store.path / f".x{SUFFIX}.abc{TEMP}"
    stale.write_bytes(b"half a write")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = store.path / f".y{SUFFIX}.abc{TEMP}"
    fresh.write_bytes(b"a write in progress")
    store.prune()
    assert not stale.exists() and fresh.exists()


def forge(path, header, state_bytes: int) -> None:
    """A file with `header` (a dict, or raw bytes), TOKENS and `state_bytes` of state left sparse (never written)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(MAGIC + struct.pack("<I", len(raw)) + raw + np.asarray(TOKENS, dtype="<i4").tobytes())
        f.truncate(f.tell() + state_bytes)


def claim(state: int) -> dict:
    """A valid header of KEY's for TOKENS with a state of `state` bytes (its digest is never reached)."""
    return {"format": 1, "key": KEY.as_json(), "tokens": len(TOKENS), "state": state, "floor": 0, "sha256": "0" * 64}


def finishes(call, seconds: float = 5.0) -> bool:
    """Whether `call` returns within `seconds` (run in a thread, which a test unblocks when it does not)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_a_symlink_under_a_files_name_is_neither_read_nor_touched_nor_counted(store, tmp_path, caplog):
    saved = store.save(KEY, TOKENS, STATE, floor=0)
    outside = tmp_path / "outside.segkv"
    os.replace(saved.path, outside)
    os.utime(outside, (1_000_000, 1_000_000))
    saved.path.symlink_to(outside)  # a valid file of KEY's, reached through a link out of the directory
    with caplog.at_level(logging.WARNING):
        assert store.find(KEY) == []
    assert saved.path.name in ignored(caplog)[0] and "not a regular file" in ignored(caplog)[0]
    store.touch(saved.path)
    store.max_bytes = 1
    store.prune()
    assert outside.stat().st_mtime == 1_000_000 and outside.exists()


def test_a_fifo_under_a_files_name_blocks_nothing(store, caplog):
    store.ensure()
    fifo = store.path / file_name(KEY, TOKENS)
    os.mkfifo(fifo)
    try:
        with caplog.at_level(logging.WARNING):
            assert finishes(lambda: store.find(KEY)), "find blocked on a FIFO"
        assert fifo.name in ignored(caplog)[0] and fifo.exists()  # not ours: skipped, not removed
        # A file found valid, then swapped for a FIFO before its state is read: load refuses it at once.
        os.unlink(fifo)
        store.save(KEY, TOKENS, STATE, floor=0)
        (stored,) = store.find(KEY)
        os.unlink(fifo)
        os.mkfifo(fifo)

        def load() -> None:
            with pytest.raises(Unusable):
                store.load(stored)

        assert finishes(load), "load blocked on a FIFO"
    finally:  # a reader still blocked in open() (the unfixed code) gets an end of file
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("bound", ["directory", "model"])
def test_a_sparse_file_claiming_a_huge_state_is_removed_unread(store, caplog, bound):
    store.ensure()
    path = store.path / file_name(KEY, TOKENS)
    forge(path, claim(1 << 30), 1 << 30)  # its size agrees with its header: only the bounds refuse it
    limit = {}
    if bound == "model":
        store.max_bytes = 4 << 30
        limit = {"per_token": 64 << 10}  # 60 tokens of at most 64 KiB each: far from 1 GiB
    with caplog.at_level(logging.WARNING):
        assert store.find(KEY, **limit) == []
    assert path.name in ignored(caplog)[0] and "(removed)" in ignored(caplog)[0] and not path.exists()


def test_a_file_grown_since_its_header_was_read_is_not_read_whole(store, caplog):
    saved = store.save(KEY, TOKENS, STATE, floor=0)
    (found,) = store.find(KEY)
    with saved.path.open("r+b") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of zeros that only a read makes real
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(Unusable):
            store.load(found)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"
    assert "changed since its header was read" in ignored(caplog)[0] and not saved.path.exists()


def test_a_deeply_nested_header_costs_only_its_own_file(store, caplog):
    good = store.save(KEY, TOKENS, STATE, floor=0)
    bad = store.path / f"{KEY.group}-{KEY.variant}-{'0' * 16}{SUFFIX}"
    forge(bad, b"[" * 200_000, 16)
    with caplog.at_level(logging.WARNING):
        (found,) = store.find(KEY)  # the intact file is still read back
    assert found.path == good.path and list(found.tokens) == list(TOKENS)
    (line,) = ignored(caplog)
    assert bad.name in line and "(removed)" in line and not bad.exists()
    assert store.save(KEY, TOKENS + 1, STATE, floor=0) is not None  # and saving goes on
