"""`segfuse bench ensembles`: two ensembles that share members on one server, loaded on demand."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Run = Callable[[int, int, int, Path], dict[str, Any]]  # (requests, in flight, max tokens, work folder) -> report


def command(
    argv: list[str] | None, doc: str, run: Run, max_tokens: int, out: str, passed: Callable[[dict[str, Any]], bool]
) -> int:
    """The command line both benchmarks share: run, write the report beside the work folder, print it; 0 when
    `passed` says the report holds."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--out", type=Path, default=Path(out))
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args.requests, args.in_flight, args.max_tokens, args.out.parent)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if passed(result) else 1
