"""`segfuse bench`: the side-by-side speed benchmark, and the serving benchmark (--serve)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ..errors import SegfuseError
from ..extras import require
from .app import app, err
from .flags import CacheOpt, ModelOpt

if TYPE_CHECKING:
    from ..bench.plan import Plan

# The options, named once here so that the command's signature reads as a list.
Lengths = Annotated[str | None, typer.Option(help="Answer lengths in tokens, comma-separated (default 128,256).")]
Reps = Annotated[
    int, typer.Option(help="Repetitions per length (median and spread); with --chat, of the whole script.")
]
Window = Annotated[int | None, typer.Option(help="Max tokens each member drafts per round (default 10).")]
Out = Annotated[
    str | None,
    typer.Option(
        help="Folder for bench.json and the per-round plot (default runs/bench); "
        "with --serve the JSON file (default runs/bench-serve.json; with --soak runs/soak.json, "
        "its plot beside it)."
    ),
]
Rss = Annotated[
    bool | None,
    typer.Option(
        "--rss/--no-rss",
        help="Measure peak RSS in subprocesses (default: unless a member is on a GPU, where it is meaningless).",
    ),
]
Reference = Annotated[
    bool | None,
    typer.Option(
        "--reference/--no-reference",
        help="Time the paper's reference method, every context re-encoded every round (default: when every member "
        "is a llama.cpp one; only they re-encode).",
    ),
]
ResponseLevel = Annotated[
    bool | None,
    typer.Option(
        "--response-level/--no-response-level",
        help="Time the response-level ensemble: every member writes the whole answer, every member scores it "
        "(default on).",
    ),
]
Users = Annotated[
    int | None,
    typer.Option(
        "--users",
        min=0,
        help="N requests at once (generate_many) against the same N one by one, for the default and plain "
        "fusion (default 4; 0: not measured).",
    ),
]
Serve = Annotated[
    bool,
    typer.Option(
        "--serve",
        help="Serving benchmark instead: the real `segfuse serve` under 1..N streaming users, "
        "serial (max_concurrent 1) vs. concurrent worker.",
    ),
]
Concurrency = Annotated[str, typer.Option(help="--serve: users in flight, comma-separated.")]
Requests = Annotated[
    int | None,
    typer.Option(
        help="--serve: requests per concurrency level (default max(8, 2 x users)); "
        "with --soak the most requests of the run (default 10 per second of it)."
    ),
]
MaxTokens = Annotated[
    int | None,
    typer.Option(
        "--max-tokens", help="--serve: max_tokens of every request (default 32; with --soak at most, default 16)."
    ),
]
MaxConcurrent = Annotated[
    int | None,
    typer.Option(
        "--max-concurrent",
        help="--serve: max_concurrent of the concurrent mode (default: the most users; "
        "with --soak the server's, default 4).",
    ),
]
Threads = Annotated[
    int | None,
    typer.Option(help="--serve: llama.cpp threads per member, the same in both modes (default: the server's)."),
]
Remote = Annotated[
    bool,
    typer.Option(
        "--remote",
        help="--serve: the members are two llama_cpp.server processes started on loopback "
        "(smollm2-135m, qwen2.5-coder-0.5b), as remote: members.",
    ),
]
Soak = Annotated[
    str | None,
    typer.Option(
        "--soak",
        metavar="DURATION",
        help="--serve: a soak instead: the server under a seeded mix of traffic "
        "for DURATION (30m, 90s, 1h30m), checking that nothing is lost or "
        "leaks (docs/reliability.md).",
    ),
]
Seed = Annotated[int | None, typer.Option(help="--soak: the seed of the traffic mix (default 0).")]
Chat = Annotated[
    bool,
    typer.Option(
        "--chat",
        help="--serve: a chat benchmark instead: a 6-turn chat and 4 users sharing a long system "
        "prompt, with the prefix cache, without it, and llama-cpp-python's server with its "
        "cache (docs/performance.md).",
    ),
]
Ray = Annotated[
    bool,
    typer.Option(
        "--ray",
        help="--serve: `segfuse serve --ray` (a local Ray instance on 127.0.0.2) beside `segfuse serve`, the "
        "same traffic in alternating blocks (default 1 and 4 users, --reps pairs); with --soak, the soak "
        "against `serve --ray` (docs/performance.md, docs/reliability.md).",
    ),
]
Replicas = Annotated[
    int | None,
    typer.Option(
        "--replicas",
        help="--ray: front-end replicas of `serve --ray` (default 1); the single-process server gets "
        "max_concurrent x replicas.",
    ),
]
Followers = Annotated[
    bool,
    typer.Option(
        "--followers",
        help="--serve: what the members the default never asks cost: the leader-alone default, "
        "eager followers and model=<leader>, side by side (docs/performance.md).",
    ),
]
DEFAULT_LEVELS = "1,2,4,8"


@app.command()
def bench(
    lengths: Lengths = None,
    reps: Reps = 3,
    model: ModelOpt = None,
    window: Window = None,
    out: Out = None,
    rss: Rss = None,
    reference: Reference = None,
    response_level: ResponseLevel = None,
    users: Users = None,
    serve: Serve = False,
    concurrency: Concurrency = DEFAULT_LEVELS,
    requests: Requests = None,
    max_tokens: MaxTokens = None,
    max_concurrent: MaxConcurrent = None,
    threads: Threads = None,
    remote: Remote = False,
    cache_dir: CacheOpt = None,
    soak: Soak = None,
    seed: Seed = None,
    chat: Chat = False,
    followers: Followers = False,
    ray: Ray = False,
    replicas: Replicas = None,
) -> None:
    """Time plain fusion (gate none, accept-margin none: every member drafts and votes every round)
    against its members, the floor, the reference method and response level, and the default (the
    leader alone) against the leader by itself; both with N users at once against one by one. Members
    may be llama.cpp or transformers ones, on the CPU or a GPU; the systems and their options are
    printed first.

    With --serve: measure the server under concurrent users instead (docs/performance.md); with
    --serve --soak DURATION: soak it under mixed traffic (docs/reliability.md); with --ray, `segfuse serve --ray`.
    """
    levels_given = concurrency != DEFAULT_LEVELS
    speed = {"lengths": lengths, "window": window, "rss": rss, "reference": reference}
    speed |= {"response_level": response_level, "users": users}
    _check_flags(
        serve,
        {name: value is not None for name, value in speed.items()},
        concurrency=levels_given,
        requests=requests is not None,
        max_tokens=max_tokens is not None,
        max_concurrent=max_concurrent is not None,
        threads=threads is not None,
        remote=remote,
        cache_dir=cache_dir is not None,
        soak=soak is not None,
        seed=seed is not None,
        chat=chat,
        followers=followers,
        ray=ray,
        replicas=replicas is not None,
    )
    if chat:
        _bench_chat(reps, max_tokens or 32, threads or 1, out)
    elif followers:
        _bench_followers(concurrency if levels_given else "1,4", requests or 8, max_tokens or 32, model, threads, out)
    elif soak is not None:
        _bench_soak(
            soak,
            seed or 0,
            requests,
            max_tokens or 16,
            model,
            threads,
            max_concurrent,
            remote,
            out,
            cache_dir,
            ray=ray,
            replicas=replicas or 1,
        )
    elif ray:
        _bench_serve_ray(
            concurrency if levels_given else "1,4",
            requests or 8,
            max_tokens or 32,
            reps,
            model,
            threads,
            max_concurrent or 4,
            replicas or 1,
            out,
            cache_dir,
        )
    elif serve:
        _bench_serve(concurrency, requests, max_tokens or 32, model, threads, max_concurrent, remote, out, cache_dir)
    else:
        _bench_local(_speed_plan(reps, **speed), model, out or "runs/bench")


def _check_flags(serve: bool, speed: dict[str, bool], **given: bool) -> None:
    """Options of the serving benchmark need --serve, those of the speed benchmark refuse it; the seed needs
    --soak, which runs its own concurrency."""
    flags = [f"--{name.replace('_', '-')}" for name, on in given.items() if on]
    if flags and not serve:
        raise SegfuseError(f"{', '.join(flags)}: options of the serving benchmark", "add --serve")
    own = [f"--{name.replace('_', '-')}" for name, on in speed.items() if on]
    if own and serve:
        raise SegfuseError(
            f"{', '.join(own)}: options of the speed benchmark (segfuse bench without --serve)",
            "leave them out with --serve",
        )
    if given["seed"] and not given["soak"]:
        raise SegfuseError("--seed: an option of the soak", "add --soak DURATION")
    modes = [f"--{name}" for name in ("soak", "chat", "followers") if given[name]]
    if len(modes) > 1:
        raise SegfuseError(f"{' and '.join(modes)}: one benchmark at a time", "run them one after another")
    if given["chat"] and (given["concurrency"] or given["remote"] or given["requests"] or given["max_concurrent"]):
        raise SegfuseError(
            "--chat sends its own scripted requests, one at a time, to the default members",
            "leave out --concurrency, --requests, --max-concurrent and --remote",
        )
    if given["followers"] and (given["remote"] or given["max_concurrent"]):
        raise SegfuseError(
            "--followers runs local members on one server as wide as its widest level",
            "leave out --remote and --max-concurrent",
        )
    if given["replicas"] and not given["ray"]:
        raise SegfuseError("--replicas: front-end replicas of `serve --ray`", "add --ray")
    if given["ray"] and (given["chat"] or given["followers"] or given["remote"]):
        raise SegfuseError(
            "--ray runs the members as Ray copies (beside a single-process server, or soaked)",
            "leave out --chat, --followers and --remote",
        )
    if given["soak"] and given["concurrency"]:
        raise SegfuseError(
            "--concurrency: the soak runs its own mix of 1 to 8 requests in flight",
            "leave out --concurrency with --soak",
        )


def _speed_plan(reps: int, **given: Any) -> Plan:
    """The speed benchmark's plan from its flags (None: not given, the default)."""
    from ..bench.plan import Plan

    return Plan(
        lengths=_lengths(given["lengths"] or "128,256"),
        reps=reps,
        window=given["window"] or 10,
        users=4 if given["users"] is None else given["users"],
        rss=given["rss"],
        reference=given["reference"],
        response_level=given["response_level"] is not False,
    )


def _lengths(lengths: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in lengths.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise SegfuseError(f"--lengths {lengths!r} is not a list of token counts", "e.g. --lengths 128,256")
    return sizes


def _bench_local(plan: Plan, model: list[str] | None, out: str) -> None:
    require("bench", "segfuse bench")
    from ..bench import local as benchmark
    from ..bench.systems import describe_systems
    from ..bench.table import tables

    report = benchmark.run(plan, model or None, Path(out), log=err.print)
    console = Console(width=240)
    for system, header, rows in tables(report):
        table = Table(*header, title=f"segfuse benchmark: {system} ({', '.join(report['models'])})")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print("; ".join(describe_systems(plan.window)))
    if report["skipped"]:
        console.print("left out: " + "; ".join(report["skipped"]))
    plot = f" and {report['plot']}" if "plot" in report else ""
    err.print(f"wrote {Path(out) / 'bench.json'}{plot}")


def _bench_serve(
    concurrency: str,
    requests: int | None,
    max_tokens: int,
    model: list[str] | None,
    threads: int | None,
    max_concurrent: int | None,
    remote: bool,
    out: str | None,
    cache_dir: str | None,
) -> None:
    from pathlib import Path

    _require_serving_clients("segfuse bench --serve", remote)
    from ..bench import serving as bench_serve

    report = bench_serve.run(
        _levels(concurrency),
        requests=requests,
        max_tokens=max_tokens,
        models=model or None,
        threads=threads,
        max_concurrent=max_concurrent,
        remote=remote,
        out=Path(out or "runs/bench-serve.json"),
        cache_dir=cache_dir,
        log=err.print,
    )
    bench_serve.print_report(report, Console(width=200, highlight=False))
    err.print(f"wrote {report['out']}")


def _bench_serve_ray(
    concurrency: str,
    requests: int,
    max_tokens: int,
    reps: int,
    model: list[str] | None,
    threads: int | None,
    max_concurrent: int,
    replicas: int,
    out: str | None,
    cache_dir: str | None,
) -> None:
    _require_serving_clients("segfuse bench --serve --ray", remote=False)
    require("ray", "segfuse bench --serve --ray")
    from ..bench import ray_serving

    report = ray_serving.run(
        _levels(concurrency),
        requests=requests,
        max_tokens=max_tokens,
        reps=reps,
        models=model or None,
        threads=threads,
        max_concurrent=max_concurrent,
        replicas=replicas,
        cache_dir=cache_dir,
        out=Path(out or "runs/bench-serve-ray.json"),
        log=err.print,
    )
    ray_serving.print_report(report, Console(width=200, highlight=False))
    err.print(f"wrote {report['out']}")


def _bench_chat(reps: int, max_tokens: int, threads: int, out: str | None) -> None:
    from pathlib import Path

    _require_serving_clients("segfuse bench --serve --chat", remote=True)  # the anchor is llama_cpp.server
    from ..bench import chat as bench_chat

    report = bench_chat.run(
        reps=reps, max_tokens=max_tokens, threads=threads, out=Path(out or "runs/bench-chat.json"), log=err.print
    )
    bench_chat.print_report(report, Console(width=200, highlight=False))
    err.print(f"wrote {report['out']}")


def _bench_followers(
    concurrency: str, requests: int, max_tokens: int, model: list[str] | None, threads: int | None, out: str | None
) -> None:
    from pathlib import Path

    _require_serving_clients("segfuse bench --serve --followers", remote=False)
    from ..bench import followers as bench_followers

    report = bench_followers.run(
        _levels(concurrency),
        requests=requests,
        max_tokens=max_tokens,
        models=model or None,
        threads=threads,
        out=Path(out or "runs/bench-followers.json"),
        log=err.print,
    )
    bench_followers.print_report(report, Console(width=200, highlight=False))
    err.print(f"wrote {report['out']}")


def _levels(concurrency: str) -> list[int]:
    try:
        return [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        raise SegfuseError(
            f"--concurrency {concurrency!r} is not a comma-separated list of numbers", "e.g. --concurrency 1,2,4,8"
        ) from None


def _require_serving_clients(command: str, remote: bool) -> None:
    from ..extras import MissingExtraError

    require("server", command)
    needed = ["openai", "httpx"] + (
        ["llama_cpp.server", "sse_starlette", "starlette_context", "pydantic_settings"] if remote else []
    )
    missing = [m for m in needed if _missing(m)]
    if missing:
        raise MissingExtraError(
            f"{command}{' --remote' if remote else ''} needs {', '.join(missing)}",
            "pip install openai httpx" + (" 'llama-cpp-python[server]'" if remote else ""),
        )


def soak_path(out: str | None) -> Path:
    """Where the soak's report goes: --out as a file, or soak.json inside a folder (as the other benches take
    --out); its folder is made now, so that a path it cannot write fails before the run, not after it."""
    path = Path(out or "runs/soak.json")
    if path.is_dir() or (out or "").endswith(("/", "\\")):
        path = path / "soak.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _bench_soak(
    duration: str,
    seed: int,
    requests: int | None,
    max_tokens: int,
    model: list[str] | None,
    threads: int | None,
    max_concurrent: int | None,
    remote: bool,
    out: str | None,
    cache_dir: str | None,
    *,
    ray: bool = False,
    replicas: int = 1,
) -> None:
    from ..bench.duration import parse_duration

    seconds = parse_duration(duration)
    _require_serving_clients("segfuse bench --serve --soak", remote)
    if ray:
        require("ray", "segfuse bench --serve --soak --ray")
    from ..bench import soak as bench_soak
    from ..bench import soak_report

    settings = bench_soak.SoakSettings(
        duration_s=seconds,
        seed=seed,
        max_tokens=max_tokens,
        max_requests=requests,
        models=tuple(model or ()),
        threads=threads,
        max_concurrent=max_concurrent or 4,
        remote=remote,
        cache_dir=cache_dir,
        ray=ray,
        replicas=replicas,
    )
    path = soak_path(out)
    report = bench_soak.run(settings, out=path, log=err.print)
    soak_report.print_report(report, Console(width=200, highlight=False))
    try:
        err.print(f"wrote {report['out']} and {soak_report.plot(report, path.with_suffix('.png'))}")
    except ImportError:
        err.print(f"wrote {report['out']} (no plot: matplotlib is missing; pip install 'segfuse[bench]')")


def _missing(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True
