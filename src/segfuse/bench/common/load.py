"""The client side of serving runs: streamed chat completions with the real `openai` client."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import SegfuseError
from .processes import SegfuseServer

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a binary search does.",
    "List three fruits that are red.",
    "What is 17 plus 25?",
    "Give a one-line Python function that reverses a string.",
    "Why do cats purr? Answer briefly.",
    "Translate 'good morning' into Spanish.",
)


@dataclass
class Outcome:
    """One request: seconds from send to the end of the stream, to the first segment, tokens, error."""

    prompt: int
    latency_s: float
    ttfs_s: float | None
    completion_tokens: int | None
    finish_reason: str | None
    error: str | None = None


def one_request(
    client: Any, prompt_index: int, max_tokens: int, model: str = "segfuse", options: dict[str, Any] | None = None
) -> Outcome:
    """One streamed chat completion of prompt `prompt_index` (cycling through PROMPTS); `options`: the
    request's ``segfuse`` extension (fusion options)."""
    t0 = time.perf_counter()
    ttfs = tokens = finish = None
    extra = {"extra_body": {"segfuse": options}} if options else {}
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[prompt_index % len(PROMPTS)]}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
        for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                if ttfs is None and choice.delta is not None and choice.delta.content:
                    ttfs = time.perf_counter() - t0
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        error = None if tokens is not None else "the stream ended without usage"
    except Exception as exc:  # an error is a measurement, not the end of the benchmark
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return Outcome(prompt_index % len(PROMPTS), time.perf_counter() - t0, ttfs, tokens, finish, error)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either was not measured (or b is 0)."""
    return a / b if a is not None and b else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarise(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    latencies = [o.latency_s for o in ok]
    ttfs = [o.ttfs_s for o in ok if o.ttfs_s is not None]
    tokens = sum(o.completion_tokens or 0 for o in ok)
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": len(outcomes) - len(ok),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p95_s": percentile(latencies, 95),
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
        "ttfs_p50_s": percentile(ttfs, 50),
        "error_messages": sorted({o.error for o in outcomes if o.error}),
    }


def drive(
    server: SegfuseServer,
    concurrency: int,
    requests: int,
    max_tokens: int,
    offset: int = 0,
    model: str = "segfuse",
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`requests` streamed completions, `concurrency` in flight at a time; the level's summary and raw data."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=900)
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix=f"bench-c{concurrency}")
    try:
        t0 = time.perf_counter()
        futures = [pool.submit(one_request, client, offset + i, max_tokens, model, options) for i in range(requests)]
        outcomes = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # on Ctrl-C: the server is stopped next, ending the rest
    client.close()
    if server.process.poll() is not None:
        raise SegfuseError(
            f"the server exited with status {server.process.returncode} during the run:\n{server.log_tail()}",
            f"see {server.log}",
        )
    return {"concurrency": concurrency, **summarise(outcomes, wall), "outcomes": [asdict(o) for o in outcomes]}
