"""lm-eval's command line run as a user runs it: `lm_eval`, or our `segfuse-lm-eval` (lm-eval with the segfuse
model and the local tasks registered), offline, from the repository's root, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtualenv's console scripts
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # the tasks' data sets from the local cache only


def run_lm_eval(
    program: str,
    model: str,
    model_args: str,
    tasks: str,
    limit: int,
    *flags: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """`program --model M --model_args A --tasks T --limit N [flags]`, with `env` (else this process's) offline."""
    found = BIN / program
    options = ["--model", model, "--model_args", model_args, "--tasks", tasks, "--limit", str(limit), *flags]
    return subprocess.run(
        [str(found) if found.exists() else program, *options],
        cwd=ROOT,
        env={**(env if env is not None else os.environ), **OFFLINE},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
