"""Chat benchmark: requests that share what came before, with and without the members' prefix cache.

Three systems answer the same scripted traffic (``script.py``), streamed, greedy:

- ``cache``: ``segfuse serve`` with its defaults (the prefix cache on, the leader answering alone);
- ``no-cache``: the same with ``prefix_cache_cells = 0``: every request reads its whole prompt;
- ``llama-server``: the anchor, llama-cpp-python's own server for the leader's GGUF, its prompt cache
  on (``--cache true``; it also keeps its last prompt's context), the same threads.

The traffic, per repetition and system (systems take turns, their order alternating, so that the
machine's noise falls on all alike): three short prompts (the reference: a prompt with nothing to
reuse), a 6-turn chat (an owner's manual as the system prompt, each answer sent back as the
assistant turn, as chat UIs do) and 4 users, one after another, who share a long system prompt and
each ask their own question. Each repetition marks its system prompts with its number, so that no
repetition reuses another's (``sections`` keeps only the documents' first sections: a shorter
script, for tests). Per request it records the time to the first content (ours: the leader's first
words as it writes them, since it answers alone by default; the anchor's first token), to the first 40
characters (about ten tokens: like for like) and to the end.

Reported, never enforced (docs/performance.md): turns 2-6 and users 2-4 with the cache against a
short prompt (target <= 1.5x) and against no cache (target >= 5x sooner), and the cache against
the anchor on the same conversation (first content <= 1.1x, first 40 characters <= 1x, whole
answer <= 0.7x).
"""

from __future__ import annotations

import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.load import ratio
from ..common.machine import loadavg, report_start, write_report
from ..common.processes import llama_cpp_server, segfuse_server, sigterm_as_interrupt
from .script import CHAT_TURNS, MANUAL, POLICY, SHORT_PROMPT, USER_QUESTIONS, excerpt

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

SYSTEMS = ("cache", "no-cache", "llama-server")
SHORT_PROMPTS = (SHORT_PROMPT, "Say hello.", "Say thanks.")
# About ten tokens of English: the same amount of answer whatever pieces a server streams it in, so
# "first words" compares like with like.
FIRST_WORDS = 40
LEADER = "qwen2.5-coder-0.5b"


@dataclass
class Reply:
    """One streamed request: seconds to the first content and to the end, what it said, its usage."""

    system: str
    rep: int
    kind: str  # "short", "chat" or "user"
    index: int  # the short prompt, chat turn or user, from 1
    ttfs_s: float | None
    first_words_s: float | None  # until the first FIRST_WORDS characters arrived (or the answer ended)
    total_s: float
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None = None


@dataclass
class Target:
    """A server the benchmark sends requests to."""

    name: str
    base_url: str  # ends in /v1
    api_key: str
    model: str
    health: Callable[[], dict[str, Any]] | None = None


def stream(
    target: Target, messages: list[ChatCompletionMessageParam], max_tokens: int
) -> tuple[float | None, float | None, float, str, int | None, int | None]:
    """One streamed chat completion: (seconds to the first content, to the first words, to the end; text,
    prompt tokens, completion tokens)."""
    from openai import OpenAI

    client = OpenAI(base_url=target.base_url, api_key=target.api_key or "none", max_retries=0, timeout=900)
    t0 = time.perf_counter()
    ttfs = words = usage = None
    parts: list[str] = []
    seen = 0
    try:
        chunks = client.chat.completions.create(
            model=target.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta is not None and chunk.choices[0].delta.content:
                ttfs = ttfs if ttfs is not None else time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
                seen += len(parts[-1])
                if words is None and seen >= FIRST_WORDS:
                    words = time.perf_counter() - t0
            usage = chunk.usage or usage
    finally:
        client.close()
    total = time.perf_counter() - t0
    return (
        ttfs,
        words if words is not None else (total if parts else None),
        total,
        "".join(parts),
        usage.prompt_tokens if usage else None,
        usage.completion_tokens if usage else None,
    )


def ask(
    target: Target, rep: int, kind: str, index: int, messages: list[ChatCompletionMessageParam], max_tokens: int
) -> Reply:
    try:
        return Reply(target.name, rep, kind, index, *stream(target, messages, max_tokens))
    except Exception as exc:  # an error is a measurement, not the end of the benchmark
        return Reply(
            target.name, rep, kind, index, None, None, 0.0, "", None, None, f"{type(exc).__name__}: {exc}"[:300]
        )


def marked(rep: int, system_prompt: str) -> str:
    """The repetition's own system prompt: its first tokens differ, so nothing carries over between reps."""
    return f"(Session {rep + 1}.) {system_prompt}"


def one_repetition(
    target: Target, rep: int, max_tokens: int, turns: int, users: int, sections: int | None = None
) -> list[Reply]:
    """The short prompts, then the chat turn by turn, then the users one after another."""
    replies = [
        ask(target, rep, "short", i, [{"role": "user", "content": p}], max_tokens)
        for i, p in enumerate(SHORT_PROMPTS, 1)
    ]
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": marked(rep, excerpt(MANUAL, sections))}]
    for turn, question in enumerate(CHAT_TURNS[:turns], 1):
        messages.append({"role": "user", "content": question})
        reply = ask(target, rep, "chat", turn, messages, max_tokens)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.text})
    policy = marked(rep, excerpt(POLICY, sections))
    for user, question in enumerate(USER_QUESTIONS[:users], 1):
        replies.append(
            ask(
                target,
                rep,
                "user",
                user,
                [{"role": "system", "content": policy}, {"role": "user", "content": question}],
                max_tokens,
            )
        )
    return replies


@contextmanager
def targets(
    workdir: Path, threads: int, log: Callable[[str], None], systems: Sequence[str] = SYSTEMS
) -> Iterator[list[Target]]:
    """The servers of `systems` on loopback (in SYSTEMS' order), stopped when the block ends."""
    from ...models import CATALOGUE, model_path

    with ExitStack() as stack:
        found = []
        for name, cells in (("cache", None), ("no-cache", 0)):
            if name not in systems:
                continue
            key = secrets.token_hex(16)
            config: dict[str, dict[str, Any]] = {
                "server": {"api_key": key, "max_concurrent": 1},
                "members": {"threads": threads, "prefix_cache_cells": cells},
            }
            log(f"starting segfuse serve ({name})…")
            server = stack.enter_context(segfuse_server(workdir, name, config))
            found.append(Target(name, server.api, key, "segfuse", server.health))
        if "llama-server" in systems:
            log(f"starting llama_cpp.server for {LEADER} (--cache true)…")
            anchor = stack.enter_context(
                llama_cpp_server(
                    model_path(CATALOGUE[LEADER]),
                    workdir / "llama-server.log",
                    threads=threads,
                    n_ctx=4096,
                    extra_args=("--cache", "true"),
                )
            )
            found.append(Target("llama-server", anchor.url, "", LEADER))
        yield found


@dataclass(frozen=True)
class Script:
    """What each repetition sends: the chat's turns, the users, the documents' sections (None: all)."""

    max_tokens: int = 32
    turns: int = len(CHAT_TURNS)
    users: int = len(USER_QUESTIONS)
    sections: int | None = None


def run(
    reps: int = 3,
    max_tokens: int = 32,
    threads: int = 1,
    turns: int = len(CHAT_TURNS),
    users: int = len(USER_QUESTIONS),
    out: Path | None = Path("runs/bench-chat.json"),
    log: Callable[[str], None] = print,
    sections: int | None = None,
    systems: Sequence[str] = SYSTEMS,
) -> dict[str, Any]:
    """Every one of `systems`, `reps` times in turn; the report (also written to `out`). `sections`: only the
    documents' first sections in the system prompts (None: all of them)."""
    script = Script(max_tokens, turns, users, sections)
    report = report_start({**asdict(script), "reps": reps, "threads": threads, "leader": LEADER})
    report["settings"]["systems"] = list(systems)
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="segfuse-bench-chat-") as tmp:
        with targets(Path(tmp), threads, log, systems) as servers:
            report["replies"] = _repetitions(servers, reps, script, log)
            report["prefix_cache"] = {s.name: _prefix_stats(s) for s in servers if s.health}
    report["loadavg"]["end"] = loadavg()
    report["summary"] = summarise(report["replies"], turns, users)
    return write_report(report, out)


def _repetitions(servers: list[Target], reps: int, script: Script, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """A warm-up request on each server, then `reps` repetitions of the script, the servers' order
    alternating; every reply."""
    for server in servers:  # warm-up: the first request of a process pays for loading pages
        ask(server, -1, "warm-up", 0, [{"role": "user", "content": "Hello."}], 4)
    replies: list[dict[str, Any]] = []
    for rep in range(reps):
        for server in servers if rep % 2 == 0 else servers[::-1]:
            done = one_repetition(server, rep, script.max_tokens, script.turns, script.users, script.sections)
            replies += [asdict(r) for r in done]
            log(f"   rep {rep + 1} {server.name:12} load {loadavg()} " + " ".join(_brief(r) for r in done))
    return replies


def _brief(reply: Reply) -> str:
    if reply.error:
        return f"{reply.kind[0]}{reply.index}:ERR"
    return f"{reply.kind[0]}{reply.index}:{reply.ttfs_s or 0:.2f}"


def _prefix_stats(target: Target) -> dict[str, Any]:
    occupancy = (target.health() if target.health else {}).get("occupancy", {})
    return {member: held.get("prefix") for member, held in occupancy.items()}


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarise(replies: Sequence[dict[str, Any]], turns: int, users: int) -> dict[str, Any]:
    """Medians over repetitions per system, kind and index; then the ratios the targets name."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for system in SYSTEMS:
        for kind, count in (("short", len(SHORT_PROMPTS)), ("chat", turns), ("user", users)):
            for index in range(1, count + 1):
                mine = [r for r in replies if (r["system"], r["kind"], r["index"]) == (system, kind, index)]
                table.setdefault(system, {})[f"{kind}{index}"] = {
                    "ttfs_s": _median([r["ttfs_s"] for r in mine]),
                    "first_words_s": _median([r["first_words_s"] for r in mine]),
                    "total_s": _median([r["total_s"] for r in mine]),
                    "prompt_tokens": _median([r["prompt_tokens"] for r in mine]),
                    "errors": sum(r["error"] is not None for r in mine),
                }
    return {"systems": table, "ratios": ratios(table, turns, users)}


def ratios(table: dict[str, dict[str, dict[str, Any]]], turns: int, users: int) -> dict[str, Any]:
    """Later turns and users against the short prompt (no cache, where nothing is reused), against no
    cache, and against the anchor; worst case over the turns or users."""
    short = _median([table["no-cache"][f"short{i}"]["ttfs_s"] for i in range(1, len(SHORT_PROMPTS) + 1)])
    later = [f"chat{t}" for t in range(2, turns + 1)] + [f"user{u}" for u in range(2, users + 1)]
    cache, none, anchor = table["cache"], table["no-cache"], table["llama-server"]

    def worst(
        keys: list[str], value: Callable[[str], float | None], pick: Callable[[list[float]], float] = max
    ) -> float | None:
        values = [v for v in (value(k) for k in keys) if v is not None]
        return pick(values) if values else None

    chats = [k for k in later if k.startswith("chat")]
    shared = [k for k in later if k.startswith("user")]
    return {
        "short_prompt_ttfs_s": short,
        "chat_later_turns_over_short": worst(chats, lambda k: ratio(cache[k]["ttfs_s"], short)),
        "chat_no_cache_over_cache": worst(chats, lambda k: ratio(none[k]["ttfs_s"], cache[k]["ttfs_s"]), min),
        "users_later_over_short": worst(shared, lambda k: ratio(cache[k]["ttfs_s"], short)),
        "users_no_cache_over_cache": worst(shared, lambda k: ratio(none[k]["ttfs_s"], cache[k]["ttfs_s"]), min),
        "chat_ttfs_cache_over_anchor": ratio(
            _median([cache[k]["ttfs_s"] for k in chats]), _median([anchor[k]["ttfs_s"] for k in chats])
        ),
        "chat_first_words_cache_over_anchor": ratio(
            _median([cache[k]["first_words_s"] for k in chats]), _median([anchor[k]["first_words_s"] for k in chats])
        ),
        "chat_total_cache_over_anchor": ratio(
            _median([cache[k]["total_s"] for k in chats]), _median([anchor[k]["total_s"] for k in chats])
        ),
    }


TARGETS = {
    "chat_later_turns_over_short": ("<=", 1.5, "chat turns 2-6, first segment with the cache / a short prompt's"),
    "chat_no_cache_over_cache": (">=", 5.0, "chat turns 2-6, first segment without the cache / with it"),
    "users_later_over_short": ("<=", 1.5, "users 2-4 of a shared system prompt, first segment / a short prompt's"),
    "chat_ttfs_cache_over_anchor": ("<=", 1.1, "chat turns 2-6, first content: ours / llama-cpp-python server's"),
    "chat_first_words_cache_over_anchor": (
        "<=",
        1.0,
        f"chat turns 2-6, first {FIRST_WORDS} characters: ours / llama-cpp-python server's",
    ),
    "chat_total_cache_over_anchor": ("<=", 0.7, "chat turns 2-6, whole answer: ours / llama-cpp-python server's"),
}


def print_report(report: dict[str, Any], console: Any) -> None:
    """Per request kind and index, the systems' median seconds to the first content; then the targets."""
    from rich.table import Table

    systems = report["summary"]["systems"]
    settings = report["settings"]
    table = Table(
        "request",
        "prompt tokens",
        *(f"{s} first / words / total (s)" for s in SYSTEMS),
        title=f"segfuse chat benchmark (leader {settings['leader']}, {settings['threads']} thread(s), "
        f"max_tokens {settings['max_tokens']}, medians of {settings['reps']} reps)",
    )
    for key, row in systems["no-cache"].items():
        cells = [" / ".join(_num(systems[s][key][k]) for k in ("ttfs_s", "first_words_s", "total_s")) for s in SYSTEMS]
        table.add_row(key, _num(row["prompt_tokens"], 0), *cells)
    console.print(table)
    targets = Table("check", "measured", "target", title="targets (reported, not enforced)")
    measured = report["summary"]["ratios"]
    for key, (op, bound, what) in TARGETS.items():
        value = measured.get(key)
        met = value is not None and (value <= bound if op == "<=" else value >= bound)
        targets.add_row(what, _num(value), f"{op} {bound} {'met' if met else 'MISSED'}")
    console.print(targets)
    console.print(
        f"short prompt (no cache): {_num(measured['short_prompt_ttfs_s'])} s to the first segment; "
        f"load average {report['loadavg']}",
        soft_wrap=True,
    )


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


__all__ = ["SYSTEMS", "TARGETS", "print_report", "run", "summarise"]
