"""Side-by-side speed benchmark: what the ensemble costs over its members.

One run, one process family, the same prompts, greedy decoding and answers
forced to the target length (``ignore_eos``). It times two systems, named with
their options in the report (``SYSTEMS``): *plain fusion* (no gate, every
proposal to the vote: every member drafts and verifies every round, the
method's full cost) and the *default* (the leader alone: the others never
start). For each answer length it measures, repeated and summarised as
median / min / max:

- ``fusion``: plain fusion (wall time, tokens/s, time to first segment);
- ``default``: the default options, against ``leader_alone`` (the leader
  member by itself, from the members-alone runs);
- ``members_sum``: each member alone generating the same number of tokens
  from the same prompt (prefill + decode), summed;
- ``floor``: the work the method cannot avoid, priced at each member's
  measured speeds: prompt prefill, its own draft decoded token by token and
  one batched read of the other members' candidates per round (token counts
  from the fusion run's backend counters);
- ``reference_method``: the paper's code path as a mode of ours: every round
  every member re-encodes its whole context to draft and again to verify;
- ``response_level``: every member writes the whole answer, then every member
  scores every answer; its time to first token is when the winner is known;
- peak RSS of the ensemble process vs. the members alone (subprocesses).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from ..backends.llama_cpp import LlamaCppMember
from ..ensemble import Ensemble
from ..errors import SegfuseError
from ..eval.baselines import rerank
from ..options import FusionOptions
from ..request import to_messages
from ..types import Message, Result, Sampling
from .machine import git, machine, peak_rss_self_mb

PROMPTS = (
    "Write a detailed essay about the history of the printing press and how it changed Europe.",
    "Explain step by step how a compiler turns source code into machine code, with examples.",
    "Describe the water cycle in detail, covering evaporation, condensation, precipitation and runoff.",
)
GREEDY = Sampling(temperature=0.0, top_p=1.0, seed=0, ignore_eos=True)
# The systems timed, by the name the report prints, and the options that make each (over FusionOptions'
# defaults). Plain fusion is the engine's worst case, what the floor, the reference method and response
# level are compared with; Model Exit's savings are measured in docs/results-256.md.
PLAIN = "plain fusion"
DEFAULT = "default (leader alone)"
SYSTEMS: dict[str, dict[str, Any]] = {
    PLAIN: {"gate": None, "accept_margin": None, "exit": False, "hedge": False},
    DEFAULT: {},
}
SHOWN_OPTIONS = ("gate", "accept_margin", "exit", "hedge", "leader", "followers")


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# --- member speeds for the floor ---------------------------------------------------


def member_speeds(
    member: LlamaCppMember, messages: Sequence[Message], context: int, batch: int, repeats: int = 5
) -> dict[str, float]:
    """Seconds per prompt token (one batch), per decoded token, and per batched token.

    Raw llama.cpp decodes through the member's own context, at a context
    as long as the mid-answer context, with nothing else done per token.
    """
    ctx = member.context
    session = member.start(messages, seed=0, reserve=1)
    try:
        prompt_len = len(session.tokens)
        t_prompt, _ = _time(session.sync)
        filler = [session.tokens[-1]] * max(0, context - prompt_len)
        pos = prompt_len
        for start in range(0, len(filler), ctx.n_batch):  # grow the context to `context`
            chunk = filler[start : start + ctx.n_batch]
            ctx.decode(chunk, range(pos, pos + len(chunk)), [0] * len(chunk), [False] * len(chunk))
            pos += len(chunk)
        decode_times = []
        for i in range(16):
            dt, _ = _time(partial(ctx.decode, [filler[0] if filler else 0], [pos + i], [0], [True]))
            decode_times.append(dt)
        ctx.seq_rm(0, pos, -1)
        batch_times = []
        for _ in range(repeats):
            ctx.seq_cp(0, 1, 0, pos)
            ids = [session.tokens[-1]] * batch
            dt, _ = _time(partial(ctx.decode, ids, range(pos, pos + batch), [1] * batch, [True] * batch))
            batch_times.append(dt)
            ctx.seq_rm(1, -1, -1)
    finally:
        session.close()
    return {
        "prompt_s_per_token": t_prompt / max(prompt_len, 1),
        "decode_s_per_token": statistics.median(decode_times),
        "batch_s_per_token": statistics.median(batch_times) / batch,
        "batch_size": batch,
    }


def floor_seconds(counters: dict[str, dict[str, int]], speeds: dict[str, dict[str, float]]) -> float:
    """Price the fusion run's necessary work at the members' raw speeds."""
    total = 0.0
    for name, c in counters.items():
        if name not in speeds:  # a member that never started (standby) did no work
            continue
        s = speeds[name]
        total += c["prompt"] * s["prompt_s_per_token"]
        total += (c["draft"] + c["catch_up"]) * s["decode_s_per_token"]
        total += c["verify"] * s["batch_s_per_token"]
    return total


# --- systems --------------------------------------------------------------------


def run_fusion(ensemble: Ensemble, prompt: str, length: int, window: int, system: str = PLAIN) -> Result:
    """One greedy answer of exactly `length` tokens from `system` (a key of SYSTEMS)."""
    return ensemble.generate(
        prompt, max_tokens=length, temperature=0.0, top_p=1.0, seed=0, ignore_eos=True, window=window, **SYSTEMS[system]
    )


def system_options(system: str, window: int) -> dict[str, Any]:
    """The options that tell the systems apart, as the engine resolves them (defaults included)."""
    options = FusionOptions.build(**SYSTEMS[system], window=window).model_dump()
    return {k: options[k] for k in ("window", *SHOWN_OPTIONS)}


def describe_systems(window: int) -> list[str]:
    """One line per system: its name and options, as printed before the table."""

    def shown(value: Any) -> Any:
        return "none" if value is None else value

    return [
        f"{name}: " + ", ".join(f"{k}={shown(v)}" for k, v in system_options(name, window).items()) for name in SYSTEMS
    ]


def member_alone_seconds(member: LlamaCppMember, messages: Sequence[Message], length: int) -> float:
    """One member generating `length` tokens by itself: prefill + decode, one session."""
    t0 = time.perf_counter()
    session = member.start(messages, seed=0, reserve=length + 1)
    try:
        session.draft(length, GREEDY)
    finally:
        session.close()
    return time.perf_counter() - t0


def peak_rss_mb(args: Sequence[str]) -> float:
    """Peak RSS (MiB) of a child process running `python -m segfuse.bench.local --child ARGS`."""
    proc = subprocess.run(
        [sys.executable, "-m", "segfuse.bench.local", "--child", *args], capture_output=True, text=True, check=True
    )
    return float(proc.stdout.strip().splitlines()[-1])


def _child(argv: Sequence[str]) -> None:
    """Subprocess body for RSS: load members, generate, print peak RSS in MiB."""
    kind, length, *names = argv
    if kind == "ensemble":
        with Ensemble(names, prefix_cache_cells=0) as ens:
            run_fusion(ens, PROMPTS[0], int(length), 10)
    else:
        with Ensemble(names, prefix_cache_cells=0) as ens:
            member_alone_seconds(llama_members(ens)[0], to_messages(PROMPTS[0]), int(length))
    print(peak_rss_self_mb())


# --- the benchmark ----------------------------------------------------------------


def llama_members(ensemble: Ensemble) -> list[LlamaCppMember]:
    """The ensemble's members: llama.cpp's, whose contexts the floor's speeds are measured on."""
    members = [m for m in ensemble.members if isinstance(m, LlamaCppMember)]
    if len(members) < len(ensemble.members):
        raise SegfuseError("the benchmark times llama.cpp members only", "name GGUF models (no remote or hf: members)")
    return members


ROWS = (
    "fusion",
    "fusion_ttfs",
    "fusion_tokens",
    "members_sum",
    "floor",
    "reference_method",
    "response_level",
    "response_ttft",
    "default",
    "default_ttfs",
    "default_tokens",
    "leader_alone",
)


def run(
    lengths: Sequence[int] = (128, 256),
    reps: int = 3,
    models: Sequence[str] | None = None,
    window: int = 10,
    out: Path = Path("runs/bench"),
    log: Callable[[str], None] = print,
    rss: bool = True,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git(),
        "window": window,
        "reps": reps,
        "systems": {name: system_options(name, window) for name in SYSTEMS},
        "lengths": {},
    }
    for line in describe_systems(window):
        log(line)
    # No prefix cache between requests: every repetition pays for its prompt, as the members alone do.
    with Ensemble(models, prefix_cache_cells=0) as ens, Ensemble(models, reencode=True) as reference:
        names = ens.names
        report["models"] = names
        report["threads"] = {m.name: m.threads for m in llama_members(ens)}
        last_result: Result | None = None
        for length in lengths:
            log(f"== answers of {length} tokens, {reps} repetitions")
            rows: dict[str, list[float]] = {k: [] for k in ROWS}
            for rep in range(reps):
                last_result = _repetition(ens, reference, PROMPTS[rep % len(PROMPTS)], length, window, rows)
                log(
                    f"  rep {rep + 1}: {PLAIN} {rows['fusion'][-1]:.1f}s ({last_result.stats.tokens} tok), "
                    f"floor {rows['floor'][-1]:.1f}s, members {rows['members_sum'][-1]:.1f}s, "
                    f"reference {rows['reference_method'][-1]:.1f}s, "
                    f"response-level {rows['response_level'][-1]:.1f}s; {DEFAULT} {rows['default'][-1]:.1f}s, "
                    f"leader alone {rows['leader_alone'][-1]:.1f}s"
                )
            entry = _summary(rows)
            if rss:
                ens_rss = peak_rss_mb(["ensemble", str(length), *names])
                alone = [peak_rss_mb(["member", str(length), n]) for n in names]
                entry["rss_mb"] = {"ensemble": ens_rss, "members": dict(zip(names, alone))}
                entry["rss_ratio"] = ens_rss / sum(alone)
            report["lengths"][str(length)] = entry
    if last_result is not None:
        report["plot"] = str(plot_rounds(last_result, out / "bench_rounds.png"))
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    return report


def _repetition(
    ens: Ensemble, reference: Ensemble, prompt: str, length: int, window: int, rows: dict[str, list[float]]
) -> Result:
    """One prompt, every system side by side: appends a time (or count) to each row; returns plain fusion's
    result."""
    messages = to_messages(prompt)
    result = run_fusion(ens, prompt, length, window, PLAIN)
    rows["fusion"].append(result.stats.total_s)
    rows["fusion_ttfs"].append(result.stats.time_to_first_segment_s or 0.0)
    rows["fusion_tokens"].append(result.stats.tokens)
    members = llama_members(ens)
    context = len(members[0].prompt_tokens(messages)) + length // 2
    speeds = {}
    for member in members:
        c = result.counters.get(member.name)
        if c is None:  # never started (only under options that leave members on standby)
            continue
        batch = max(1, round(c["verify"] / max(c["verify_calls"], 1)))
        speeds[member.name] = member_speeds(member, messages, context, batch)
    rows["floor"].append(floor_seconds(result.counters, speeds))
    alone = {m.name: member_alone_seconds(m, messages, length) for m in members}
    rows["members_sum"].append(sum(alone.values()))
    default = run_fusion(ens, prompt, length, window, DEFAULT)
    rows["default"].append(default.stats.total_s)
    rows["default_ttfs"].append(default.stats.time_to_first_segment_s or 0.0)
    rows["default_tokens"].append(default.stats.tokens)
    rows["leader_alone"].append(alone[default_leader(default)])
    rows["reference_method"].append(run_fusion(reference, prompt, length, window).stats.total_s)
    response = rerank(ens.members, messages, max_tokens=length, sampling=GREEDY)
    rows["response_level"].append(response.total_s)
    rows["response_ttft"].append(response.ttft_s or response.total_s)
    return result


def _summary(rows: dict[str, list[float]]) -> dict[str, Any]:
    """Spreads of every row and the ratios of medians the benchmark reports."""
    entry: dict[str, Any] = {k: spread(v) for k, v in rows.items()}
    med = {k: v["median"] for k, v in entry.items()}
    entry["fusion_tokens_per_s"] = med["fusion_tokens"] / med["fusion"]
    entry["ratio_vs_floor"] = med["fusion"] / med["floor"]
    entry["ratio_vs_members_sum"] = med["fusion"] / med["members_sum"]
    entry["ratio_reference_over_fusion"] = med["reference_method"] / med["fusion"]
    entry["ttfs_over_response_ttft"] = med["fusion_ttfs"] / med["response_ttft"]
    entry["default_tokens_per_s"] = med["default_tokens"] / med["default"]
    entry["default_over_leader_alone"] = med["default"] / med["leader_alone"]
    return entry


def default_leader(result: Result) -> str:
    """The member that answered under the default: the one that drafted (the others stay on standby)."""
    return max(result.counters, key=lambda name: result.counters[name]["draft"])


def plot_rounds(result: Result, path: Path) -> Path:
    """Stacked bars per round: each member's draft and verify time, and the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = result.models
    rounds = result.rounds
    x = list(range(1, len(rounds) + 1))
    fig, ax = plt.subplots(figsize=(max(6, len(rounds) * 0.25), 4))
    bottom = [0.0] * len(rounds)
    colours = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        for phase, attr, hatch in (("draft", "draft_s", ""), ("verify", "verify_s", "//")):
            heights = [getattr(r, attr).get(name, 0.0) for r in rounds]
            ax.bar(x, heights, bottom=bottom, color=colours(i), hatch=hatch, edgecolor="white", label=f"{name} {phase}")
            bottom = [b + h for b, h in zip(bottom, heights)]
    other = [max(0.0, r.total_s - b) for r, b in zip(rounds, bottom)]
    ax.bar(x, other, bottom=bottom, color="lightgrey", label="other (rank, broadcast, Python)")
    ax.set_xlabel("round")
    ax.set_ylabel("seconds")
    ax.set_title(f"Time per round, {result.stats.tokens}-token answer")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(report: dict[str, Any]) -> list[list[str]]:
    """Rows for a printed table: one per length."""
    rows = []
    for length, e in report["lengths"].items():
        rows.append(
            [
                length,
                f"{e['fusion']['median']:.1f} s ({e['fusion_tokens_per_s']:.1f} tok/s)",
                f"{e['fusion_ttfs']['median']:.2f} s",
                f"{e['floor']['median']:.1f} s",
                f"{e['members_sum']['median']:.1f} s",
                f"{e['reference_method']['median']:.1f} s",
                f"{e['response_ttft']['median']:.1f} s",
                f"{e['ratio_vs_floor']:.2f}",
                f"{e['ratio_vs_members_sum']:.2f}",
                f"{e['ratio_reference_over_fusion']:.2f}",
                f"{e['ttfs_over_response_ttft']:.3f}",
                f"{e['rss_ratio']:.2f}" if "rss_ratio" in e else "–",
                f"{e['default']['median']:.1f} s ({e['default_tokens_per_s']:.1f} tok/s)",
                f"{e['leader_alone']['median']:.1f} s",
                f"{e['default_over_leader_alone']:.2f}",
            ]
        )
    return rows


# "plain fusion" columns first (the floor, members, reference and response level are its comparisons),
# then the default against its leader alone.
TABLE_HEADER = [
    "tokens",
    PLAIN,
    "first segment",
    "floor",
    "members Σ",
    "reference",
    "response TTFT",
    "vs floor",
    "vs members Σ",
    "reference / plain",
    "TTFS / response TTFT",
    "RSS ratio",
    DEFAULT,
    "leader alone",
    "default / leader alone",
]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    _child(sys.argv[2:])
