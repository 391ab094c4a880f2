"""Peak resident memory of the ensemble against its members alone, each in a process of its own.

A child (``python -m segfuse.bench.speed.rss KIND LENGTH SPEC...``) loads the ensemble of the member specs, or the
one member, writes one answer of LENGTH tokens and prints its peak RSS in MiB. On a GPU the weights and
caches live in the card's memory, so RSS says nothing there: the benchmark leaves it out.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from ...ensemble import Ensemble
from ...request import to_messages
from ..common.machine import peak_rss_self_mb
from .systems import PROMPTS, member_alone_seconds, run_fusion


def peak_rss_mb(kind: str, length: int, specs: Sequence[str]) -> float:
    """Peak RSS (MiB) of a child running the ensemble of `specs` (`kind` "ensemble") or the one member
    (`kind` "member") for one answer of `length` tokens."""
    proc = subprocess.run(
        [sys.executable, "-m", "segfuse.bench.speed.rss", kind, str(length), *specs],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(proc.stdout.strip().splitlines()[-1])


def child(argv: Sequence[str]) -> None:
    """The child's body: load, generate, print peak RSS in MiB."""
    kind, length, *specs = argv
    with Ensemble(specs, prefix_cache_cells=0) as ens:
        if kind == "ensemble":
            run_fusion(ens, PROMPTS[0], int(length), 10)
        else:
            member_alone_seconds(ens.members[0], to_messages(PROMPTS[0]), int(length))
    print(peak_rss_self_mb())


if __name__ == "__main__":
    child(sys.argv[1:])
