"""A vLLM server on loopback serving an embedded model: what ``make test-vllm`` runs its tests against.

vLLM lives in a virtual environment of its own (it pins its own torch); this module runs in segfuse's.
It converts an embedded model's GGUF into a Hugging Face checkpoint folder once (bf16, with its
tokenizer and chat template), starts vLLM's OpenAI-compatible server for it on a free loopback port
in a process group of its own, runs a command with ``SEGFUSE_VLLM_URL`` set to the server's ``/v1``
URL, and stops the server and its engine process whatever happens (an error, Ctrl-C, SIGTERM)::

    python -m segfuse.bench.common.vllm --python .cache/vllm/venv/bin/python --dir .cache/vllm \\
        -- python -m pytest -m vllm tests/test_vllm.py
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ...errors import SegfuseError
from .processes import free_port, running, sigterm_as_interrupt, wait_until_serving

URL_VARIABLE = "SEGFUSE_VLLM_URL"
"""Where tests/test_vllm.py finds the server (its ``/v1`` URL)."""


def export_checkpoint(name: str, out: Path) -> Path:
    """`out`: the embedded model `name` as a Hugging Face checkpoint folder in bf16 (converted once)."""
    if (out / "config.json").is_file():
        return out
    import torch

    from ... import models
    from ...backends.transformers.load import convert_gguf

    spec = models.get_spec(name)
    if not models.is_ready(spec):
        raise SegfuseError(f"{name} is not prepared", "run `segfuse models prepare` (or `make models`)")
    out.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(models.model_path(spec), torch.bfloat16, None, target=out)
    return out


@dataclass
class VllmServer:
    url: str  # ends in /v1
    log: Path
    startup_s: float


@contextmanager
def vllm_server(
    python: str,
    model_dir: Path,
    log: Path,
    *,
    served_name: str,
    max_model_len: int = 2048,
    kv_cache_gib: int = 1,
    startup_s: float = 600,
) -> Iterator[VllmServer]:
    """vLLM's OpenAI-compatible server (`python` is its environment's interpreter) for `model_dir`."""
    port = free_port()
    args = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
    ]
    env = {
        **{k: v for k, v in os.environ.items() if k != "SEGFUSE_API_KEY"},
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),  # GiB; its default takes a large share of memory
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }  # nothing leaves the machine
    started = time.monotonic()
    with running(args, log, signal.SIGTERM, 20, env, group=True) as process:
        url = f"http://127.0.0.1:{port}/v1"
        wait_until_serving(process, f"{url}/models", startup_s, log)
        yield VllmServer(url, log, time.monotonic() - started)


def run(python: str, workdir: Path, model: str, command: Sequence[str]) -> int:
    """Export `model`, serve it with vLLM, run `command` against it; the command's exit status."""
    if not Path(python).is_file():
        raise SegfuseError(f"no vLLM environment at {python}", "run `make test-vllm`, which creates it")
    started = time.monotonic()
    model_dir = export_checkpoint(model, workdir / "models" / model)
    print(f"checkpoint {model_dir} ready in {time.monotonic() - started:.0f} s", flush=True)
    with (
        sigterm_as_interrupt(),
        vllm_server(python, model_dir, workdir / "vllm-server.log", served_name=f"{model}-vllm") as server,
    ):
        print(
            f"vLLM serving {model}-vllm at {server.url}, ready in {server.startup_s:.0f} s (log: {server.log})",
            flush=True,
        )
        return subprocess.call(list(command), env={**os.environ, URL_VARIABLE: server.url})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m segfuse.bench.common.vllm", description=__doc__.split("\n")[0])
    parser.add_argument("--python", required=True, help="the vLLM environment's python")
    parser.add_argument("--dir", type=Path, default=Path(".cache/vllm"), help="where the checkpoint and log go")
    parser.add_argument("--model", default="smollm2-135m", help="the embedded model to serve")
    parser.add_argument("command", nargs="+", help="what to run against the server (after --)")
    args = parser.parse_args(argv)
    try:
        return run(args.python, args.dir, args.model, args.command)
    except SegfuseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
