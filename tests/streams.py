"""A chat completion streamed from a running `segfuse serve` over raw HTTP, read as an SSE client reads it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx

from segfuse.bench.common.processes import SegfuseServer


def stream_chat(server: SegfuseServer, body: dict[str, Any], timeout: float) -> AbstractContextManager[httpx.Response]:
    """POST `body` to the server's /chat/completions with its API key, the response left open to stream."""
    return httpx.stream(
        "POST",
        f"{server.api}/chat/completions",
        json=body,
        timeout=timeout,
        headers={"Authorization": f"Bearer {server.api_key}"},
    )


def data_frames(response: httpx.Response) -> Iterator[str]:
    """The payloads of the stream's `data:` lines, as they arrive (the last one `[DONE]`)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]
