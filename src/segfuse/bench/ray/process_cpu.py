"""CPU time a server's processes spend, by role: where a serving run's time goes, process by process.

A server in one process is one role. ``segfuse serve --ray`` with a local instance is a tree: the
command, Ray's GCS and raylet, and Ray's workers (Serve's controller and proxy, the front-end
replicas, the members' copies, the shared state), each known by its process title. A
:class:`CpuMeter` notes every process of the tree and reads user + system seconds; the difference
between two readings is what each role spent in between (a process that appeared since counts
whole, one that ended counts what it had at its last reading; an idle worker that became an actor
counts under the actor's role).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil

# Title prefix -> role, first match wins (a worker's title is "ray::<actor class>[...]").
ROLES = (
    ("ray::MemberHost", "member copies"),
    ("ray::ServeReplica:segfuse:Front", "front-end replicas"),
    ("ray::ServeReplica", "Serve: other replicas (keeper)"),
    ("ray::ProxyActor", "Serve: proxy"),
    ("ray::ServeController", "Serve: controller"),
    ("ray::SharedState", "shared state"),
    ("ray::", "Ray: other workers"),
    ("raylet", "Ray: raylet"),
    ("gcs_server", "Ray: GCS"),
)
OTHER_RAY = "Ray: other processes"  # log monitor, dashboard agents, idle workers' launchers...
COMMAND = "the command (driver)"


def role(title: str, is_root: bool) -> str:
    """A process's role from its title (its command line as Ray sets it)."""
    if is_root:
        return COMMAND
    for prefix, name in ROLES:
        if title.startswith(prefix) or f"/{prefix}" in title.split(" ", 1)[0]:
            return name
    return OTHER_RAY


@dataclass
class CpuMeter:
    """The process tree under `pid` (it included), read on each :meth:`read`."""

    pid: int
    _procs: dict[int, psutil.Process] = field(default_factory=dict)
    _roles: dict[int, str] = field(default_factory=dict)
    _last: dict[int, float] = field(default_factory=dict)

    def read(self) -> dict[str, float]:
        """CPU seconds (user + system) each role has spent so far, of every process seen since the first read."""
        try:
            root = psutil.Process(self.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for proc in tree:  # titled again each time: an idle Ray worker may have become an actor since
            try:
                title = " ".join(proc.cmdline()) or proc.name()
            except psutil.Error:
                continue
            self._procs.setdefault(proc.pid, proc)
            self._roles[proc.pid] = role(title, proc.pid == self.pid)
        for pid, proc in self._procs.items():
            try:
                times = proc.cpu_times()
                self._last[pid] = times.user + times.system
            except psutil.Error:
                pass  # ended: its last reading stands
        totals: dict[str, float] = {}
        for pid, seconds in self._last.items():
            totals[self._roles[pid]] = totals.get(self._roles[pid], 0.0) + seconds
        return totals


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds each role spent between two readings, largest first (roles that spent nothing left out)."""
    out = {name: after[name] - before.get(name, 0.0) for name in after}
    return dict(sorted(((k, round(v, 3)) for k, v in out.items() if v > 0.0005), key=lambda kv: -kv[1]))


__all__ = ["CpuMeter", "role", "spent"]
