"""Time to first content on each API of one server, for the same prompts, interleaved in one run.

Starts the app over the embedded members (in this process, served by uvicorn on loopback, as
`segfuse serve` serves it), then for each round sends the round's prompt, streamed, to chat
completions, Messages and Responses in turn (the order rotates each round), and times from the request
to the first frame that carries answer text: a chat chunk with content, a ``content_block_delta``, a
``response.output_text.delta``. Prints, as JSON, each API's median, its ratio to chat's median, and the
median over rounds of its time over chat's in the same round (paired: the load of the moment cancels).

    python -m segfuse.bench.serve.api_first_content --rounds 12 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn

from ...config import ServerConfig
from ...ensemble import Ensemble
from ...server.app import create_app, uvicorn_settings

PROMPTS = [
    "Name a primary colour.",
    "What is the capital of France?",
    "Say hello in Spanish.",
    "Name a large planet.",
    "What is two plus two?",
    "Name a fruit that is yellow.",
]


def _chat(prompt: str, model: str, n: int) -> tuple[str, dict[str, Any], Callable[[str, str], bool]]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "stream": True}
    return (
        "/v1/chat/completions",
        body,
        lambda event, data: bool(
            data.startswith("{") and (json.loads(data)["choices"] or [{}])[0].get("delta", {}).get("content")
        ),
    )


def _messages(prompt: str, model: str, n: int) -> tuple[str, dict[str, Any], Callable[[str, str], bool]]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "stream": True}
    return "/v1/messages", body, lambda event, data: event == "content_block_delta"


def _responses(prompt: str, model: str, n: int) -> tuple[str, dict[str, Any], Callable[[str, str], bool]]:
    body = {"model": model, "input": prompt, "max_output_tokens": n, "stream": True}
    return "/v1/responses", body, lambda event, data: event == "response.output_text.delta"


APIS = {"chat": _chat, "messages": _messages, "responses": _responses}


def first_content(
    client: httpx.Client, path: str, body: dict[str, Any], is_content: Callable[[str, str], bool]
) -> float | None:
    """Seconds from sending the request to its first frame with answer text (None: the answer had none)."""
    started = time.perf_counter()
    seen: float | None = None
    event = ""
    with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # read to the end: the next request starts on an idle server
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and seen is None and is_content(event, line[6:]):
                seen = time.perf_counter() - started
    return seen


def serve(ensemble: Ensemble) -> tuple[uvicorn.Server, threading.Thread, str]:
    config = ServerConfig.model_validate(
        {"server": {"port": 0, "log_level": "warning"}, "defaults": {"temperature": 0}}
    )
    runner = uvicorn.Server(uvicorn.Config(create_app(config, ensemble), **uvicorn_settings(config)))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    while not runner.started:
        time.sleep(0.1)
    return runner, thread, f"http://127.0.0.1:{runner.servers[0].sockets[0].getsockname()[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default="segfuse", help="the fused model, or one member alone")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per member")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in APIS}
    paired: dict[str, list[float]] = {name: [] for name in APIS}  # each round: the API's time over chat's
    with Ensemble(threads=args.threads) as ensemble:
        runner, thread, url = serve(ensemble)
        with httpx.Client(base_url=url, timeout=600) as client:
            first_content(client, *_chat(PROMPTS[0], args.model, 2))  # warm-up, not counted
            for i in range(args.rounds):
                prompt, order = PROMPTS[i % len(PROMPTS)], list(APIS)
                order = order[i % 3 :] + order[: i % 3]  # each API goes first, second and third as often
                seen = {name: first_content(client, *APIS[name](prompt, args.model, args.max_tokens)) for name in order}
                for name, seconds in seen.items():
                    if seconds is not None:
                        times[name].append(seconds)
                        if seen["chat"]:
                            paired[name].append(seconds / seen["chat"])
        runner.should_exit = True
        thread.join(30)
    medians = {name: statistics.median(values) for name, values in times.items() if values}
    report = {
        "model": args.model,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "median_first_content_s": {k: round(v, 4) for k, v in medians.items()},
        "ratio_to_chat": {k: round(v / medians["chat"], 3) for k, v in medians.items()},
        "median_paired_ratio": {k: round(statistics.median(v), 3) for k, v in paired.items() if v},
        "samples": {k: len(v) for k, v in times.items()},
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
