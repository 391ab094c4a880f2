"""Several users on one leader: what `segfuse serve` gains from answering them together, against what
llama.cpp gains by itself from decoding the same number of sequences in one batch, and drafting at that load.

Two parts, one after the other on the same machine (the first is done and its memory freed before the
server starts):

- **llama.cpp's own batch gain**: the leader's GGUF loaded as a member (its context, threads and KV cache as
  the server loads it), driven by raw ``llama_decode`` calls with nothing of the engine: the prompts read
  (not timed), then `tokens` greedy steps of one sequence alone, and of `users` sequences one token each per
  decode; the gain is the batch's tokens/s over the lone sequence's.
- **the server**: one ``segfuse serve`` (the default members, the leader answering alone, ``max_concurrent``
  = `users`) driven with the real ``openai`` client, streaming, answers of exactly `tokens` tokens
  (``ignore_eos``): at 1 user, then `users` at once, for each drafting mode (``off``, ``auto``), in
  repetitions that take turns so a drift of the machine falls on all alike.

The checks, printed and never enforced: the server's gain at `users` with drafting off over llama.cpp's own
(>= 0.8), and ``auto``'s tokens/s at `users` over ``off``'s (>= 0.97: drafting must not cost the crowd).
"""

from __future__ import annotations

import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...request import to_messages
from ..common.load import PROMPTS, drive, ratio
from ..common.machine import loadavg, report_start, write_report
from ..common.processes import segfuse_server, sigterm_as_interrupt

LEADER = "qwen2.5-coder-0.5b"  # the default ensemble's largest member: the one that answers
MODES = ("off", "auto")
TARGETS = {
    "server_over_native": (0.8, "the server's gain at N users (draft off) / llama.cpp's own N-sequence batch gain"),
    "auto_over_off": (0.97, "tokens/s at N users, draft auto / draft off"),
}


@dataclass(frozen=True)
class UsersPlan:
    users: int = 4
    tokens: int = 64
    reps: int = 2
    threads: int | None = None  # llama.cpp's per member (None: the server's default)
    leader: str = LEADER


# --------------------------------------------------------------------------- llama.cpp by itself


def lone_and_batched(context: Any, prompts: Sequence[Sequence[int]], tokens: int) -> tuple[float, float]:
    """Seconds for `tokens` greedy steps of the first prompt's sequence alone, then of every prompt's
    sequence together (one token each per decode); the prompts are read first, untimed."""

    def steps(seqs: list[int]) -> float:
        context.clear()
        last, pos = [], []
        for seq in seqs:
            prompt = list(prompts[seq])
            rows = context.decode(prompt, range(len(prompt)), [seq] * len(prompt), [False] * (len(prompt) - 1) + [True])
            last.append(int(rows[-1].argmax()))
            pos.append(len(prompt))
        t0 = time.perf_counter()
        for _ in range(tokens):
            rows = context.decode(last, pos, seqs, [True] * len(seqs))
            last = [int(row.argmax()) for row in rows]
            pos = [p + 1 for p in pos]
        return time.perf_counter() - t0

    return steps([0]), steps(list(range(len(prompts))))


def native_gain(plan: UsersPlan, log: Callable[[str], None]) -> dict[str, Any]:
    """llama.cpp's tokens/s for `plan.users` sequences in one batch over one sequence's, per repetition."""
    from ...backends.registry import load_member

    member: Any = load_member(plan.leader, threads=plan.threads, slots=plan.users, prefix_cache_cells=0)
    try:
        prompts = [member.prompt_tokens(to_messages(PROMPTS[i % len(PROMPTS)])) for i in range(plan.users)]
        lone_and_batched(member.context, prompts, 8)  # first-call costs out of the timings
        gains, lone, together = [], [], []
        for rep in range(plan.reps):
            one, many = lone_and_batched(member.context, prompts, plan.tokens)
            lone.append(plan.tokens / one)
            together.append(plan.users * plan.tokens / many)
            gains.append(together[-1] / lone[-1])
            log(f"  llama.cpp rep {rep + 1}: 1 sequence {lone[-1]:.1f} tok/s, {plan.users} {together[-1]:.1f} tok/s")
        return {
            "threads": member.threads,
            "lone_tokens_per_s": lone,
            "batch_tokens_per_s": together,
            "gain": statistics.median(gains),
            "gains": gains,
        }
    finally:
        member.close()


# --------------------------------------------------------------------------- the server


def server_config(plan: UsersPlan) -> dict[str, dict[str, Any]]:
    return {
        "server": {"api_key": secrets.token_hex(16), "max_concurrent": plan.users, "queue_size": 4 * plan.users},
        "members": {"threads": plan.threads},
    }


def serve_levels(plan: UsersPlan, workdir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Per drafting mode and level (1 user, `plan.users`): each repetition's summary from ``drive``."""
    levels: dict[str, dict[str, list[dict[str, Any]]]] = {m: {"1": [], str(plan.users): []} for m in MODES}
    with segfuse_server(workdir, "users", server_config(plan)) as server:
        members = server.health().get("members")
        drive(server, 1, 1, plan.tokens, offset=len(PROMPTS) - 1)  # warm-up
        for rep in range(plan.reps):
            for mode in MODES if rep % 2 == 0 else reversed(MODES):
                options = {"draft": mode, "ignore_eos": True}
                for users, requests in ((1, plan.users), (plan.users, 2 * plan.users)):
                    level = drive(server, users, requests, plan.tokens, options=options)
                    level.pop("outcomes")
                    levels[mode][str(users)].append(level)
                    log(
                        f"  serve rep {rep + 1}, draft {mode}, {users} user(s): "
                        f"{level['output_tokens_per_s']:.1f} tok/s, errors {level['errors']}"
                    )
    return {"members": members, "levels": levels}


def median_of(entries: list[dict[str, Any]], key: str) -> float | None:
    values = [e[key] for e in entries if e.get(key) is not None]
    return statistics.median(values) if values else None


def summary(plan: UsersPlan, native: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """The medians, the gains and the checks."""
    n = str(plan.users)
    tok = {m: {lvl: median_of(served["levels"][m][lvl], "output_tokens_per_s") for lvl in ("1", n)} for m in MODES}
    gains = {m: ratio(tok[m][n], tok[m]["1"]) for m in MODES}
    measured = {
        "server_over_native": ratio(gains["off"], native["gain"]),
        "auto_over_off": ratio(tok["auto"][n], tok["off"][n]),
    }
    checks = {}
    for key, (bound, what) in TARGETS.items():
        value = measured[key]
        checks[key] = {"measured": value, "target": f">= {bound}", "met": None if value is None else value >= bound}
        checks[key]["what"] = what
    return {"tokens_per_s": tok, "server_gain": gains, "native_gain": native["gain"], "checks": checks}


def run(plan: UsersPlan, out: Path | None, log: Callable[[str], None] = print) -> dict[str, Any]:
    if plan.users < 2 or plan.tokens < 1 or plan.reps < 1:
        raise ValueError("users must be at least 2, tokens and reps at least 1")
    report: dict[str, Any] = report_start({**plan.__dict__, "prompts": list(PROMPTS), "modes": list(MODES)})
    log(f"== llama.cpp by itself: {plan.leader}, 1 sequence against {plan.users} in one batch")
    report["native"] = native_gain(plan, log)
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="segfuse-bench-users-") as workdir:
        log(f"== segfuse serve (max_concurrent {plan.users}): 1 user, then {plan.users}, draft off and auto")
        report["serve"] = serve_levels(plan, Path(workdir), log)
    report["loadavg"]["end"] = loadavg()
    report["summary"] = summary(plan, report["native"], report["serve"])
    return write_report(report, out)
