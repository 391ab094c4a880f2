"""`segfuse bench ensembles`: two ensembles that share members on one server, loaded on demand."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KEY = "bench-key"  # the API key of the servers these benchmarks start
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


def ask(api: str, model: str, max_tokens: int, index: int) -> dict[str, Any]:
    """One chat completion: its model, seconds, and what went wrong (None: a complete answer by `model`)."""
    import openai

    client = openai.OpenAI(base_url=api, api_key=KEY, max_retries=0, timeout=600)
    started = time.perf_counter()
    try:
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Name colour number {index}."}], max_tokens=max_tokens
        )
        choice = answer.choices[0]
        complete = choice.finish_reason in ("stop", "length") and choice.message.content is not None
        error = None if complete and answer.model == model else f"incomplete: {choice.finish_reason}, {answer.model}"
    except openai.OpenAIError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"model": model, "seconds": time.perf_counter() - started, "error": error}
