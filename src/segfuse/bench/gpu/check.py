"""The GPU check: `segfuse bench`'s table for three real model shapes on one card, in one short run.

Run through the pack's ``check.py`` (``bootstrap.py``), which installs the pack's wheels first; it needs
torch and transformers and nothing else of ours. Phases, in order:

- ``environment``: the card, torch, transformers, Python, segfuse's version, file and packed commit;
- ``build``: the three members of ``models.py`` (random weights, real shapes) saved as checkpoints;
- ``load``: loaded back as ``transformers:`` members in one ensemble (no prefix cache);
- ``diagnose``: the leader's bare cached greedy loop on the main thread, new threads, without cuDNN's
  attention, and on the member's compute thread (``diagnose.py``);
- ``drafting``: what a pass of k drafted tokens costs the leader against one token, each drafter's time per
  token against the leader's, and the speed-up predicted from acceptance rates measured on a CPU
  (``drafting.py``);
- ``warm_up``, ``table``, ``users``: the benchmark's warm-up, its table at ``--tokens`` (no reference method,
  no response level, no RSS) and its users rows (``speed/local.py``, ``speed/users.py``).

Everything goes into ``gpu-check.json`` in ``--out``, written again as each phase ends, so a run cut short
still leaves what it measured. A phase that would start once ``--budget`` seconds are spent is skipped; the
table and the users also stop between repetitions then.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..speed.plan import Plan
    from .models import Shape

REPORT = "gpu-check.json"


class Check:
    """One run's settings, its report (written after every phase) and what the phases hand on."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic() - args.install_s  # the wheels' install counts against the budget
        self.deadline = self.started + args.budget
        self.path = args.out / REPORT
        self.doc: dict[str, Any] = {
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "phases": {},
        }
        self.state: dict[str, Any] = {}

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.path.write_text(json.dumps(self.doc, indent=2, default=str))

    def phase(self, name: str, body: Callable[[], dict[str, Any]], needs: tuple[str, ...] = ()) -> None:
        """Run one phase unless the budget is spent or a phase it needs did not finish; record it either way."""
        entry: dict[str, Any] = self.doc["phases"].setdefault(name, {})
        missing = [n for n in needs if self.doc["phases"].get(n, {}).get("status") != "done"]
        if missing:
            entry.update(status="skipped", why=f"needs {', '.join(missing)}")
        elif time.monotonic() > self.deadline:
            entry.update(status="skipped", why=f"time budget of {self.args.budget:.0f} s spent")
        else:
            print(f"== {name}", flush=True)
            t0 = time.monotonic()
            try:
                entry.update(status="done", figures=body())
            except Exception as exc:  # recorded: the phases after it still run or are skipped, never lost
                entry.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            entry["seconds"] = round(time.monotonic() - t0, 2)
            entry.update(_gpu_memory())
        print(f"   {name}: {entry['status']} {entry.get('why') or entry.get('error') or ''}", flush=True)
        self.write()


def _gpu_memory() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def environment(pack: Path) -> dict[str, Any]:
    """The card, the libraries' versions, segfuse's version, file and commit (as packed)."""
    import torch
    import transformers

    import segfuse

    from ..common.machine import machine

    packed = json.loads((pack / "pack.json").read_text()) if (pack / "pack.json").is_file() else {}
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "segfuse": segfuse.__version__,
        "segfuse_file": segfuse.__file__,
        "packed": {k: packed.get(k) for k in ("segfuse_version", "git", "created", "dependencies")},
        "machine": machine(),
    }
    if torch.cuda.is_available():
        found["card"] = torch.cuda.get_device_name(0)
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        found["card_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        found["cudnn"] = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return found


def build(check: Check, tmp: Path) -> dict[str, Any]:
    """Every shape's random checkpoint, with its tokenizer from the pack; their specs go to `check.state`."""
    from .models import SHAPES

    figures, specs = {}, []
    for shape in SHAPES:
        t0 = time.monotonic()
        spec, size = checkpoint(check, tmp, shape)
        figures[shape.name] = {"seconds": round(time.monotonic() - t0, 2), "checkpoint_gib": round(size / 2**30, 3)}
        specs.append(spec)
    check.state["specs"] = specs
    return figures


def checkpoint(check: Check, tmp: Path, shape: Shape) -> tuple[str, int]:
    """`shape`'s random checkpoint in `tmp`, its tokenizer from the pack: its member spec and its bytes."""
    from .models import build_checkpoint, member_spec

    args = check.args
    tokenizer = tmp / "tokenizers" / shape.tokenizer
    if not tokenizer.is_dir():
        with tarfile.open(args.pack / "tokenizers" / f"{shape.tokenizer}.tar.gz") as tar:
            tar.extractall(tokenizer, filter="data")
    folder = build_checkpoint(
        shape, tokenizer, tmp / "models" / shape.name, device=args.device, dtype=args.dtype, small=args.small
    )
    return member_spec(folder, shape, args.device, args.dtype), sum(p.stat().st_size for p in folder.iterdir())


def load(check: Check) -> dict[str, Any]:
    from ...ensemble import Ensemble
    from ..speed.local import member_info

    ens = Ensemble(check.state["specs"], prefix_cache_cells=0)
    check.state["ensemble"] = ens
    return {"members": {m.name: member_info(m) for m in ens.members}}


def diagnosis(check: Check) -> dict[str, Any]:
    from ...request import to_messages
    from ..speed.systems import PROMPTS
    from .diagnose import diagnose

    ens = check.state["ensemble"]
    leader = max(ens.members, key=lambda m: m.n_params or 0)
    prompt = leader.prompt_tokens(to_messages(PROMPTS[0]))
    return diagnose(leader, prompt, check.args.diagnose_tokens)


def drafting(check: Check, tmp: Path) -> dict[str, Any]:
    """The drafting rows (``drafting.py``) for the leader, with the ensemble's members that have an acceptance
    row and the drafter shapes built here for it (loaded alone, closed after)."""
    from ...backends.registry import load_member
    from ..speed.systems import PROMPTS
    from .drafting import ACCEPTANCES, measure, tables
    from .models import DRAFTER_SHAPES

    ens, args = check.state["ensemble"], check.args
    leader = max(ens.members, key=lambda m: m.n_params or 0)
    extra = [load_member(checkpoint(check, tmp, shape)[0]) for shape in DRAFTER_SHAPES]
    try:
        named = {a.drafter for a in ACCEPTANCES}
        drafters = [*extra, *(m for m in ens.members if m.name in named and m is not leader)]
        figures = measure(leader, drafters, PROMPTS[0], args.diagnose_tokens, args.reps)
    finally:
        for member in extra:
            member.close()
    figures["tables"] = [{"title": t, "header": h, "rows": r} for t, h, r in tables(figures)]
    return figures


def imported() -> list[str]:
    """The distributions of every module loaded so far beyond the standard library (what the run needed)."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    tops = {name.partition(".")[0] for name in list(sys.modules)} - set(sys.stdlib_module_names)
    return sorted({dist for top in tops for dist in owners.get(top, ())})


def plan_of(check: Check) -> Plan:
    from ..speed.plan import Plan

    args = check.args
    return Plan(
        lengths=(args.tokens,),
        reps=args.reps,
        window=args.window,
        users=args.users,
        rss=False,
        reference=False,
        response_level=False,
        plot=False,
        deadline=check.deadline,
    )


def warm(check: Check) -> dict[str, Any]:
    from ..speed.local import warm_up

    ens = check.state["ensemble"]
    return {"seconds": warm_up(ens, None, ens, plan_of(check))}


def table(check: Check) -> dict[str, Any]:
    """The table's rows at `--tokens` (reps interleaved), their summary, and the last plain fusion's work."""
    from ..speed.local import measure_length
    from ..speed.table import summary

    rows, last = measure_length(check.state["ensemble"], None, plan_of(check), check.args.tokens)
    check.state["rows"] = rows
    figures: dict[str, Any] = {"entry": summary(rows)}
    if last is not None:
        figures["last_plain_fusion"] = {"rounds": len(last.rounds), "counters": last.counters}
    return figures


def users(check: Check) -> dict[str, Any]:
    from ..speed.table import summary
    from ..speed.users import measure_users

    rows = check.state.setdefault("rows", {})
    rows.update(measure_users(check.state["ensemble"], plan_of(check), check.args.tokens))
    return {"entry": summary(rows)}


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n" + " | ".join(header))
    for line in rows:
        print(" | ".join(line))


def summarise(check: Check) -> None:
    """The table (as `segfuse bench` prints it) into the report and on standard output, then the drafting rows."""
    bench_tables(check)
    drafted = check.doc["phases"].get("drafting", {}).get("figures", {})
    for shown in drafted.get("tables", []):  # in the report already, as the phase's figures
        print_table(shown["title"], shown["header"], shown["rows"])


def bench_tables(check: Check) -> None:
    from ..speed.systems import SYSTEMS, system_options
    from ..speed.table import summary, tables

    rows = check.state.get("rows")
    if not rows:
        return
    report = {"users": check.args.users, "lengths": {str(check.args.tokens): summary(rows)}}
    check.doc["bench"] = {
        "systems": {name: system_options(name, check.args.window) for name in SYSTEMS},
        **report,
        "tables": [{"system": s, "header": h, "rows": r} for s, h, r in tables(report)],
    }
    check.write()
    for system, header, lines in tables(report):
        print_table(system, header, lines)


def run(args: argparse.Namespace) -> int:
    check = Check(args)
    args.out.mkdir(parents=True, exist_ok=True)
    check.phase("environment", lambda: environment(args.pack))
    with tempfile.TemporaryDirectory(prefix="segfuse-gpu-check-") as name:
        tmp = Path(name)
        check.phase("build", lambda: build(check, tmp))
        check.phase("load", lambda: load(check), needs=("build",))
        check.phase("diagnose", lambda: diagnosis(check), needs=("load",))
        check.phase("drafting", lambda: drafting(check, tmp), needs=("load",))
        check.phase("warm_up", lambda: warm(check), needs=("load",))
        check.phase("table", lambda: table(check), needs=("warm_up",))
        check.phase("users", lambda: users(check), needs=("warm_up",))
        summarise(check)
        if "ensemble" in check.state:
            check.state["ensemble"].close()
    check.doc["imported"] = imported()
    check.write()
    print(f"wrote {check.path} ({check.doc['elapsed_s']} s)")
    return 0 if all(p["status"] != "failed" for p in check.doc["phases"].values()) else 1


# The check's settings but the pack and the folder, at their defaults; `segfuse bench gpu` takes the same.
DEFAULTS: dict[str, Any] = {
    "budget": 420.0,
    "small": False,
    "dtype": "bf16",
    "tokens": 128,
    "reps": 3,
    "users": 4,
    "window": 10,
    "diagnose_tokens": 64,
    "install_s": 0.0,
}
DTYPES = ("bf16", "fp16", "fp32")


def default_device() -> str:
    """The first card torch sees, else the CPU."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 PACK/check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--pack", type=Path, required=True, help="the pack (python -m segfuse.bench.gpu.pack)")
    parser.add_argument("--out", type=Path, required=True, help=f"the folder for {REPORT}")
    parser.add_argument("--budget", type=float, help="seconds after which phases are skipped")
    parser.add_argument("--small", action="store_true", help="every shape shrunk (2 layers, hidden 64): a dry run")
    parser.add_argument("--device")
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--tokens", type=int, help="the answers' length")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--users", type=int, help="requests at once against one by one (0: not timed)")
    parser.add_argument("--window", type=int)
    parser.add_argument("--diagnose-tokens", type=int)
    parser.add_argument("--install-s", type=float, help=argparse.SUPPRESS)  # set by check.py
    parser.set_defaults(**DEFAULTS)
    args = parser.parse_args(argv)
    args.device = args.device or default_device()
    return args


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(parse(argv)))


if __name__ == "__main__":
    main()
