"""The GPU check's first step, copied into the pack as ``check.py``: standard library only.

``python3 PACK/check.py --out DIR [options of segfuse.bench.gpu.check]`` installs the pack's wheels
(segfuse's own and its dependencies') into a temporary folder with ``pip install --no-index --no-deps
--target``, then runs ``python3 -m segfuse.bench.gpu.check`` with that folder first on the path: the
installed segfuse, not a source tree (ahead of any PYTHONPATH given). The folder is removed at the end; the
check's exit status is this script's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = ["-S"] if sys.flags.no_site else []  # run without site-packages: so are its child processes


def install(pack: Path, target: Path) -> float:
    """pip installs the pack's wheels into `target`, offline and without resolving; its seconds."""
    wheels = sorted(str(w) for w in (pack / "wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {pack / 'wheels'}: make the pack again (python -m segfuse.bench.gpu.pack)")
    started = time.monotonic()
    command = [
        sys.executable,
        *FLAGS,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--no-deps",
        "--target",
        str(target),
    ]
    subprocess.run([*command, *wheels], check=True)
    return time.monotonic() - started


def main(argv: list[str]) -> int:
    pack = Path(__file__).resolve().parent
    work = Path(tempfile.mkdtemp(prefix="segfuse-gpu-"))
    try:
        site = work / "site"
        seconds = install(pack, site)
        path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "PYTHONNOUSERSITE": "1"}
        # -P: nothing of the working folder on the path (a source tree there must not shadow the wheel)
        command = [
            sys.executable,
            *FLAGS,
            "-P",
            "-m",
            "segfuse.bench.gpu.check",
            "--pack",
            str(pack),
            "--install-s",
            f"{seconds:.1f}",
        ]
        return subprocess.run([*command, *argv], env=env).returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
