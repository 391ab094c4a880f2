"""The prefix cache across restarts (``prefix_cache_dir``) on the real embedded members.

A member closed with a directory writes its cached prefixes there; started again on the same
directory, a session whose prompt matches reads one back instead of decoding it. What must never
be read back: a file of another model or other settings, a truncated one, a prefix cached under
another salt (or none). Timing figures live in ``python -m segfuse.bench.chat.restart_cache``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import httpx
import pytest

from helpers import API_KEY, checked_server, wait_for
from segfuse import Ensemble
from segfuse.backends.prefix_files import SUFFIX, PrefixDir, file_name
from segfuse.types import Message

pytestmark = pytest.mark.models

ITEMS = ["atlases", "maps", "newspapers", "journals", "recordings", "films", "manuscripts", "theses"]
# About 2,000 tokens for each embedded member's tokenizer: a shared system prompt, as an agent sends.
SYSTEM = "You are the library's assistant. Answer in one short sentence, using only these rules.\n" + "\n".join(
    f"Rule {i}: {ITEMS[i % 8]} of shelf {i} may be borrowed for {i % 5 + 2} weeks by members of "
    f"group {chr(65 + i % 7)}, renewed {i % 3} times, and returned to desk {i % 4 + 1}."
    for i in range(60)
)
SHORT = "\n".join(SYSTEM.splitlines()[:13])  # about 500 tokens: enough to tell a restore from a cold read
QUESTION = "For how many weeks may atlases of shelf 0 be borrowed?"
SMALL = "smollm2-135m"


def messages(question: str = QUESTION, system: str = SHORT) -> list[Message]:
    return [Message("system", system), Message("user", question)]


def opened(ensemble: Ensemble, salt: str | None = None, chat: list[Message] | None = None) -> dict[str, int]:
    """The one member's counters for a session that reads `chat` (default: the system prompt and the question)."""
    session = ensemble.members[0].start(chat or messages(), seed=0, reserve=16, cache_salt=salt)
    try:
        session.score([" Two weeks."])  # reads the prompt (the rest of it, after a cached prefix), then scores
        return session.counters() | {"prompt_len": session.prompt_len}
    finally:
        session.close()


def restored(ensemble: Ensemble) -> int:
    return ensemble.members[0].occupancy().prefix.restored


def files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{SUFFIX}"))


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "prefix cache: ignoring" in r.getMessage()]


def test_a_salted_prefix_comes_back_only_under_its_salt(tmp_path):
    with Ensemble([SMALL], prefix_cache_dir=str(tmp_path), threads=1) as first:
        cold = opened(first, salt="tenant-a")
    assert cold["reused"] == 0 and len(files(tmp_path)) == 1
    assert all(b"tenant-a" not in path.read_bytes() for path in files(tmp_path))  # a digest, never the salt
    with Ensemble([SMALL], prefix_cache_dir=str(tmp_path), threads=1) as second:
        assert opened(second)["reused"] == 0  # no salt is a salt of its own
        assert opened(second, salt="tenant-b")["reused"] == 0
        assert restored(second) == 0
        warm = opened(second, salt="tenant-a")
        assert restored(second) == 1
        assert warm["reused"] == warm["prompt_len"] - 1 and warm["prompt"] == 1
        assert second.members[0].occupancy().stray_cells == 0


def test_a_truncated_file_is_ignored_with_one_log_line_and_the_answer_still_comes(tmp_path, caplog):
    greedy = {"temperature": 0.0, "max_tokens": 12}
    with Ensemble([SMALL], prefix_cache_dir=str(tmp_path), threads=1) as first:
        cold = first.generate(messages(), **greedy)
    (path,) = files(tmp_path)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with caplog.at_level(logging.WARNING), Ensemble([SMALL], prefix_cache_dir=str(tmp_path), threads=1) as second:
        again = second.generate(messages(), **greedy)
        assert restored(second) == 0 and again.counters[SMALL]["reused"] == 0
        assert again.text == cold.text  # read from position 0 on a fresh member both times
    (line,) = warnings(caplog)
    assert path.name in line and "truncated" in line and "(removed)" in line


def test_files_of_another_model_or_other_settings_are_ignored(tmp_path, caplog):
    with Ensemble([SMALL], prefix_cache_dir=str(tmp_path), threads=1) as first:
        opened(first)
        key = first.members[0].table.disk.key(None)
    (written,) = PrefixDir(tmp_path).find(key)
    with caplog.at_level(logging.WARNING):
        # The same model with another window: its files share a name's model part, and the key refuses them.
        with Ensemble([SMALL], prefix_cache_dir=str(tmp_path), threads=1, n_ctx=2048) as other:
            assert opened(other)["reused"] == 0 and restored(other) == 0
        assert "other settings: n_ctx 4096 (here 2048)" in warnings(caplog)[0]
        # Another model on the same directory never looks at the first one's files; copied under the
        # other model's name, a file is refused by its header.
        with Ensemble(["gemma3-270m"], prefix_cache_dir=str(tmp_path), threads=1) as gemma:
            shutil.copy(written.path, tmp_path / file_name(gemma.members[0].table.disk.key(None), written.tokens))
            assert opened(gemma)["reused"] == 0 and restored(gemma) == 0
        assert "written for another model" in warnings(caplog)[-1]


def ask(url: str, question: str = QUESTION) -> dict:
    body = {
        "model": "segfuse",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 16,
    }
    reply = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def prefix_figures(server) -> dict[str, dict]:
    return {name: held["prefix"] for name, held in server.health()["occupancy"].items()}


@pytest.mark.slow
def test_a_restarted_server_reads_the_system_prompt_back_from_its_directory(tmp_path):
    cache = tmp_path / "prefixes"
    flags = ("--prefix-cache-dir", str(cache), "--prefix-cache-save-minutes", "0.02")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    with checked_server(tmp_path / "one", extra_args=flags) as server:
        first = ask(server.url)
        lengths = first["segfuse"]["prompt_tokens"]
        assert min(lengths.values()) >= 1800, lengths  # the system prompt is about 2,000 tokens for each
        # The members that read the prompt (by default the leader alone, unless the others were asked to vote)
        readers = [name for name, f in prefix_figures(server).items() if f["cells"] > 0]
        assert readers and all(f["restored"] == 0 for f in prefix_figures(server).values())
        # Written every 1.2 s while it runs (and again at shutdown): a file per member that read it.
        wait_for(lambda: len(files(cache)) >= len(readers), 60, what="the periodic write")
    with checked_server(tmp_path / "two", extra_args=flags) as server:
        again = ask(server.url)
        figures = prefix_figures(server)
        log = server.log.read_text(errors="replace")
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    for name in readers:
        read = figures[name]
        assert read["restored"] == 1 and read["reused_tokens"] == lengths[name] - 1, (name, read, lengths)
    assert log.count("prefix cache: read back") == len(readers)
