"""A small client for OpenAI-compatible ``/v1/completions`` servers.

One pooled ``httpx.Client`` per remote member (thread-safe, so concurrent
rounds share its connections). Transient failures (connection errors,
timeouts, HTTP 408/429/5xx) are retried with exponential backoff; anything
else, or a transient failure that outlasts the retries, raises
RemoteServerError with what the server said. Nothing is swallowed: the engine
decides what a failing member means for the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from ...errors import SegfuseError

TRANSIENT_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class RemoteServerError(SegfuseError):
    """A remote member's server failed, refused a request or answered nonsense."""


@dataclass(frozen=True)
class RetryPolicy:
    """`retries` extra attempts after the first, sleeping backoff * 2**k between them."""

    retries: int = 2
    backoff_s: float = 0.25
    max_backoff_s: float = 4.0

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2.0**attempt))


class CompletionClient:
    """POSTs JSON to one server; returns decoded JSON or raises RemoteServerError."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        retry: RetryPolicy | None = None,
        max_connections: int = 8,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def get(self, path: str) -> Any:
        return self._request("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        url = path if "://" in path else f"{self.base_url}{path}"  # a full URL: beside the base (vLLM's /tokenize)
        last: str = ""
        for attempt in range(self.retry.retries + 1):
            if attempt:
                time.sleep(self.retry.delay(attempt - 1))
            try:
                response = self._http.request(method, path, json=body)
            except httpx.TimeoutException as exc:
                last = f"timed out ({type(exc).__name__})"
                continue
            except httpx.TransportError as exc:
                last = f"connection failed ({type(exc).__name__}: {exc})"
                continue
            if response.status_code in TRANSIENT_STATUS:
                last = f"HTTP {response.status_code}: {_excerpt(response)}"
                continue
            if response.status_code >= 400:
                raise RemoteServerError(
                    f"{method} {url} was refused: HTTP {response.status_code}: {_excerpt(response)}",
                    "check the member's options against what this server supports",
                )
            try:
                return response.json()
            except ValueError:
                raise RemoteServerError(
                    f"{method} {url} did not return JSON: {_excerpt(response)}", "is this an OpenAI-compatible server?"
                ) from None
        raise RemoteServerError(
            f"{method} {url} failed after {self.retry.retries + 1} attempts: {last}",
            "is the server running and reachable?",
        )

    def close(self) -> None:
        self._http.close()


def _excerpt(response: httpx.Response, limit: int = 300) -> str:
    text = response.text.strip().replace("\n", " ")
    return text[:limit] + ("…" if len(text) > limit else "")
