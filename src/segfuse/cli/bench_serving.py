"""`segfuse bench serve | chat | followers | soak | ray | ensembles`: the benchmarks that run the real `segfuse serve`."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, NamedTuple

import typer
from rich.console import Console

from ..errors import SegfuseError
from ..extras import require
from .app import err
from .bench import bench_app
from .flags import CacheOpt, ModelOpt

# The options, named once here so that the commands' signatures read as lists; each command's help shows its
# own default, and the help of an option that means something else in one command is its own.
Concurrency = Annotated[str, typer.Option(help="Users in flight, comma-separated: one level after another.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", help="max_tokens of every request.")]
Threads = Annotated[int | None, typer.Option(help="llama.cpp threads per member (default: the server's).")]
Remote = Annotated[
    bool,
    typer.Option(
        "--remote",
        help="The members are two llama_cpp.server processes started on loopback "
        "(smollm2-135m, qwen2.5-coder-0.5b), as remote: members.",
    ),
]
Replicas = Annotated[int, typer.Option("--replicas", min=1, help="Front-end replicas of `serve --ray`.")]
Report = Annotated[str, typer.Option(help="The report (JSON).")]
ServeRequests = Annotated[int | None, typer.Option(help="Requests per concurrency level (default max(8, 2 x users)).")]
ServeWidth = Annotated[
    int | None,
    typer.Option("--max-concurrent", help="max_concurrent of the concurrent mode (default: the most users)."),
]
ChatReps = Annotated[int, typer.Option(help="Repetitions of the whole script.")]
ChatThreads = Annotated[int, typer.Option(help="llama.cpp threads per member, on every server.")]
LevelRequests = Annotated[int, typer.Option(help="Requests per concurrency level.")]
Duration = Annotated[str, typer.Argument(metavar="DURATION", help="How long: 30m, 90s, 1h30m.")]
Seed = Annotated[int, typer.Option(help="The seed of the traffic mix.")]
SoakRequests = Annotated[int | None, typer.Option(help="The most requests of the run (default 10 per second of it).")]
SoakMaxTokens = Annotated[int, typer.Option("--max-tokens", help="max_tokens of a request, at most.")]
SoakWidth = Annotated[int, typer.Option("--max-concurrent", help="The server's max_concurrent.")]
SoakRay = Annotated[bool, typer.Option("--ray", help="Soak `segfuse serve --ray` (a local Ray instance on 127.0.0.2).")]
SoakReplicas = Annotated[
    int | None, typer.Option("--replicas", min=1, help="With --ray: its front-end replicas (default 1).")
]
SoakOut = Annotated[
    str, typer.Option(help="The report (JSON; a folder: soak.json in it), its plot and the server's log beside it.")
]
BlockRequests = Annotated[int, typer.Option(help="Requests per concurrency level and block.")]
Pairs = Annotated[int, typer.Option(help="Pairs of blocks, in turns single, ray, ray, single, ...")]
RayWidth = Annotated[
    int,
    typer.Option(
        "--max-concurrent", help="max_concurrent of `serve --ray`; the single-process server gets it x replicas."
    ),
]


class LevelOptions(NamedTuple):
    """What the benchmarks by concurrency level (serve, followers, ray) all take."""

    concurrency: str
    requests: int | None
    max_tokens: int
    model: list[str] | None
    threads: int | None
    out: str


def _console() -> Console:
    return Console(width=200, highlight=False)


@bench_app.command()
def serve(
    concurrency: Concurrency = "1,2,4,8",
    requests: ServeRequests = None,
    max_tokens: MaxTokens = 32,
    model: ModelOpt = None,
    threads: Threads = None,
    max_concurrent: ServeWidth = None,
    remote: Remote = False,
    out: Report = "runs/bench-serve.json",
    cache_dir: CacheOpt = None,
) -> None:
    """The real `segfuse serve` under 1..N streaming users, serial (max_concurrent 1) against the concurrent
    worker (docs/performance.md)."""
    _require_serving_clients(f"segfuse bench serve{' --remote' if remote else ''}", remote)
    from ..bench.serve import serving as bench_serve

    _run_levels(
        bench_serve,
        LevelOptions(concurrency, requests, max_tokens, model, threads, out),
        max_concurrent=max_concurrent,
        remote=remote,
        cache_dir=cache_dir,
    )


@bench_app.command()
def chat(
    reps: ChatReps = 3,
    max_tokens: MaxTokens = 32,
    threads: ChatThreads = 1,
    out: Report = "runs/bench-chat.json",
) -> None:
    """A 6-turn chat and 4 users sharing a long system prompt, with the prefix cache, without it, and
    llama-cpp-python's server with its cache, on the default members (docs/performance.md)."""
    _require_serving_clients("segfuse bench chat", llama_server=True)  # the anchor is llama_cpp.server
    from ..bench.chat import run as bench_chat

    _run_and_print(bench_chat, out, reps=reps, max_tokens=max_tokens, threads=threads)


@bench_app.command()
def followers(
    concurrency: Concurrency = "1,4",
    requests: LevelRequests = 8,
    max_tokens: MaxTokens = 32,
    model: ModelOpt = None,
    threads: Threads = None,
    out: Report = "runs/bench-followers.json",
) -> None:
    """What the members the default never asks cost: the leader-alone default, eager followers and
    model=<leader>, side by side, on one server as wide as the widest level (docs/performance.md)."""
    _require_serving_clients("segfuse bench followers", llama_server=False)
    from ..bench.followers import run as bench_followers

    _run_levels(bench_followers, LevelOptions(concurrency, requests, max_tokens, model, threads, out))


@bench_app.command()
def soak(
    duration: Duration,
    seed: Seed = 0,
    requests: SoakRequests = None,
    max_tokens: SoakMaxTokens = 16,
    model: ModelOpt = None,
    threads: Threads = None,
    max_concurrent: SoakWidth = 4,
    remote: Remote = False,
    ray: SoakRay = False,
    replicas: SoakReplicas = None,
    out: SoakOut = "runs/soak.json",
    cache_dir: CacheOpt = None,
) -> None:
    """The server under a seeded mix of traffic for DURATION, checking that nothing is lost or leaks
    (docs/reliability.md)."""
    from ..bench.soak.duration import parse_duration

    seconds = parse_duration(duration)
    if replicas is not None and not ray:
        raise SegfuseError("--replicas: front-end replicas of `serve --ray`", "add --ray")
    _require_serving_clients(f"segfuse bench soak{' --remote' if remote else ''}", remote)
    if ray:
        require("ray", "segfuse bench soak --ray")
    from ..bench.soak import run as bench_soak

    settings = bench_soak.SoakSettings(
        duration_s=seconds,
        seed=seed,
        max_tokens=max_tokens,
        max_requests=requests,
        models=tuple(model or ()),
        threads=threads,
        max_concurrent=max_concurrent,
        remote=remote,
        cache_dir=cache_dir,
        ray=ray,
        replicas=replicas or 1,
    )
    _soak_report(bench_soak.run(settings, out=soak_path(out), log=err.print))


def soak_path(out: str) -> Path:
    """Where the soak's report goes: --out as a file, or soak.json inside a folder (as the other benches take
    --out); its folder is made now, so that a path it cannot write fails before the run, not after it."""
    path = Path(out)
    if path.is_dir() or out.endswith(("/", "\\")):
        path = path / "soak.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _soak_report(report: dict[str, Any]) -> None:
    """The soak's tables, and its plot beside its report."""
    from ..bench.soak import report as soak_report

    soak_report.print_report(report, _console())
    path = Path(str(report["out"]))
    try:
        err.print(f"wrote {path} and {soak_report.plot(report, path.with_suffix('.png'))}")
    except ImportError:
        err.print(f"wrote {path} (no plot: matplotlib is missing; pip install 'segfuse[bench]')")


@bench_app.command("ray")
def ray_serve(
    concurrency: Concurrency = "1,4",
    requests: BlockRequests = 8,
    max_tokens: MaxTokens = 32,
    reps: Pairs = 3,
    model: ModelOpt = None,
    threads: Threads = None,
    max_concurrent: RayWidth = 4,
    replicas: Replicas = 1,
    out: Report = "runs/bench-serve-ray.json",
    cache_dir: CacheOpt = None,
) -> None:
    """`segfuse serve --ray` (a local Ray instance on 127.0.0.2) beside `segfuse serve`, the same traffic in
    alternating blocks, then one call to a Ray member against a local one (docs/performance.md)."""
    _require_serving_clients("segfuse bench ray", llama_server=False)
    require("ray", "segfuse bench ray")
    from ..bench.ray import serving as ray_serving

    _run_levels(
        ray_serving,
        LevelOptions(concurrency, requests, max_tokens, model, threads, out),
        reps=reps,
        max_concurrent=max_concurrent,
        replicas=replicas,
        cache_dir=cache_dir,
    )


@bench_app.command()
def ensembles(
    requests: Annotated[int, typer.Option(help="Requests, alternating between the two ensembles.")] = 200,
    in_flight: Annotated[int, typer.Option("--in-flight", help="Requests in flight at once.")] = 4,
    max_tokens: MaxTokens = 8,
    out: Report = "runs/on-demand.json",
    budget: Annotated[
        bool, typer.Option("--budget", help="A byte budget of two of three members instead (runs/budget.json).")
    ] = False,
) -> None:
    """Two ensembles that share members on one server (small: smollm2 + gemma3, preloaded; full: the three,
    loaded on demand), requests alternating between them: nothing may fail, nothing may load twice
    (docs/server.md, Several models). With --budget: small and coder (smollm2 + qwen2.5-coder 0.5B) under a
    max_loaded_bytes that fits two of the three members; the loaded bytes may never pass it."""
    _require_serving_clients("segfuse bench ensembles", llama_server=False)
    from ..bench.ensembles import budget as budgeted
    from ..bench.ensembles import on_demand

    args = ["--requests", str(requests), "--in-flight", str(in_flight), "--max-tokens", str(max_tokens)]
    if budget and out == "runs/on-demand.json":
        out = "runs/budget.json"
    code = (budgeted if budget else on_demand).main([*args, "--out", out])
    if code:
        raise typer.Exit(code)


def _run_levels(bench: ModuleType, shared: LevelOptions, **more: Any) -> None:
    """One of the benchmarks by concurrency level (serve, followers, ray): the options they all take, and
    `more` of its own."""
    options = {"requests": shared.requests, "max_tokens": shared.max_tokens, "threads": shared.threads}
    _run_and_print(bench, shared.out, _levels(shared.concurrency), models=shared.model or None, **options, **more)


def _run_and_print(bench: ModuleType, out: str, *args: Any, **options: Any) -> None:
    """`bench.run(*args, **options)` writing its report to `out`, its tables, and where the report went."""
    report = bench.run(*args, out=Path(out), log=err.print, **options)
    bench.print_report(report, _console())
    err.print(f"wrote {report['out']}")


def _levels(concurrency: str) -> list[int]:
    try:
        return [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        raise SegfuseError(
            f"--concurrency {concurrency!r} is not a comma-separated list of numbers", "e.g. --concurrency 1,2,4,8"
        ) from None


def _require_serving_clients(command: str, llama_server: bool) -> None:
    """The server's extra and the clients the benchmark drives it with (with `llama_server`, llama-cpp-python's
    own server too), before anything starts."""
    from ..extras import MissingExtraError

    require("server", command)
    needed = ["openai", "httpx"] + (
        ["llama_cpp.server", "sse_starlette", "starlette_context", "pydantic_settings"] if llama_server else []
    )
    missing = [m for m in needed if _missing(m)]
    if missing:
        raise MissingExtraError(
            f"{command} needs {', '.join(missing)}",
            "pip install openai httpx" + (" 'llama-cpp-python[server]'" if llama_server else ""),
        )


def _missing(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True
