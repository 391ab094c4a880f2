"""What a benchmark report records about the machine, the code and the process."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, platform and Python version."""
    cpu = platform.processor() or platform.machine()
    memory_gib = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 1,
        "memory_gib": memory_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "hostname": platform.node(),
    }


def git() -> dict[str, Any] | None:
    """The commit the code runs at, and whether tracked files differ from it."""
    root = Path(__file__).resolve().parents[4]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)} if commit else None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def report_start(settings: dict[str, Any]) -> dict[str, Any]:
    """What every benchmark report opens with: the date, the machine, the commit, the settings, the load
    average now (the caller adds it at the end)."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git(),
        "settings": settings,
        "loadavg": {"start": loadavg()},
    }


def write_report(report: dict[str, Any], out: Path | None) -> dict[str, Any]:
    """`report` as JSON in `out` (its folder made), which it then names; as it is where `out` is None."""
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        report["out"] = str(out)
    return report


def peak_rss_self_mb() -> float:
    """This process's peak resident set (VmHWM).

    Not ru_maxrss: Linux carries that across exec from the parent, so a child
    of a big process would report the parent's size.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tree_pids(pid: int) -> list[int]:
    """`pid` and every process below it (a `serve --ray` command's Ray instance and its workers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return []


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie, ended but not yet reaped, counts as ended)."""
    import psutil

    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.Error:
            continue
    return running


def tree_rss_mb(pid: int) -> float | None:
    """Resident memory of a process and every process below it, in MiB (pages they share count in each)."""
    sizes = [rss_mb(p) for p in tree_pids(pid)]
    known = [s for s in sizes if s is not None]
    return sum(known) if known else None


def rss_mb(pid: int) -> float | None:
    """Resident memory of a running process (VmRSS), in MiB; None if it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
