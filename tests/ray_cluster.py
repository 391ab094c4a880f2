"""A real two-node Ray cluster on loopback for tests, and what its processes do on the network.

The nodes are 127.0.0.2 (head) and 127.0.0.3, never 127.0.0.1 or localhost (Ray would rewrite
those into the machine's network address). Every Ray process the cluster starts is a descendant
of the test process: they are noted while the cluster runs, and :meth:`LoopbackCluster.stop`
ends the cluster by its own handles (``ray.shutdown``, ``cluster.shutdown``; never ``ray stop``,
which would end other people's Ray processes) and says which of them are still alive.
"""

from __future__ import annotations

import ipaddress
import os

import psutil

HEAD, WORKER = "127.0.0.2", "127.0.0.3"
CPUS_PER_NODE = 2
RAY_NAMES = (
    "raylet",
    "gcs_server",
    "ray::",
    "default_worker",
    "dashboard",
    "log_monitor",
    "monitor.py",
    "runtime_env",
    "agent",
)


class LoopbackCluster:
    """Start with :meth:`start`, end with :meth:`stop` (safe to call twice)."""

    def __init__(self) -> None:
        self.cluster = None
        self.seen: dict[int, psutil.Process] = {}

    def start(self) -> LoopbackCluster:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # Ray reports usage over the internet unless told not to
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"node_ip_address": HEAD, "num_cpus": CPUS_PER_NODE, "include_dashboard": False},
        )
        try:
            self.cluster.add_node(node_ip_address=WORKER, num_cpus=CPUS_PER_NODE)
            ray.init(address=self.cluster.address, _node_ip_address=HEAD)
        except BaseException:
            self.stop()
            raise
        self.note()
        return self

    @property
    def address(self) -> str:
        assert self.cluster is not None
        return self.cluster.address

    def note(self) -> list[psutil.Process]:
        """The Ray processes this cluster runs now (added to those noted before)."""
        for proc in psutil.Process().children(recursive=True):
            try:
                if any(name in " ".join(proc.cmdline()) or name in proc.name() for name in RAY_NAMES):
                    self.seen.setdefault(proc.pid, proc)
            except psutil.Error:
                continue
        return [p for p in self.seen.values() if p.is_running()]

    def stop(self, wait_s: float = 30.0) -> list[psutil.Process]:
        """Shut the cluster down; the noted Ray processes still alive `wait_s` later."""
        import ray

        self.note()
        try:
            ray.shutdown()
        finally:
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=wait_s)
        return alive


def sockets(procs: list[psutil.Process]) -> tuple[set[str], set[str]]:
    """(addresses the processes listen on, remote addresses of their connections), as IP strings."""
    listening, remote = set(), set()
    for proc in procs:
        try:
            connections = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in connections:
            if c.status == psutil.CONN_LISTEN:
                listening.add(c.laddr.ip)
            elif c.raddr:
                remote.add(c.raddr.ip)
    return listening, remote


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def is_wildcard(ip: str) -> bool:
    return ip in ("0.0.0.0", "::")
