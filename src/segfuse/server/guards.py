"""What keeps a server safe from the clients it cannot trust: browsers, internals in error texts, log lines.

- ``Gate`` refuses a Host header the server does not answer to (DNS rebinding: a web page whose
  name resolves to 127.0.0.1 would otherwise read a keyless local server's answers), and headers
  larger than the limit;
- ``media_type_error`` says why a body is not ``application/json`` (a page may POST ``text/plain``
  anywhere without asking, but ``application/json`` makes the browser ask first, and we say no);
- ``redact`` takes file paths, URLs and tracebacks out of texts that came from inside (load errors,
  member faults) before they reach a client that does not hold the API key;
- ``quoted`` writes a client's string into the log safely (``repr``, cut short).

How long a connection may take to send its request, and how many may wait, is ``connections.py``'s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
AsgiMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[AsgiMessage]]
Send = Callable[[AsgiMessage], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def host_name(header: str) -> str:
    """A Host header's name, lower case, without the port (``[::1]:8000`` -> ``::1``)."""
    value = header.strip().lower()
    if value.startswith("["):  # an IPv6 literal
        return value[1 : value.find("]")] if "]" in value else value
    name, colon, port = value.rpartition(":")
    return name if colon and port.isdigit() and ":" not in name else value


def error_body(code: str, message: str, kind: str = "invalid_request_error") -> tuple[list[tuple[bytes, bytes]], bytes]:
    """An OpenAI-shaped error's headers and JSON body, for the answers sent before any route."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


class Gate:
    """Pure ASGI middleware, before any route: a Host the server does not answer to gets 400 ``invalid_host``
    (``allowed`` None: any), a request line and headers over ``max_header_bytes`` get 431 (uvicorn's own
    bound applies only to headers that arrive in pieces)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None, max_header_bytes: int) -> None:
        self.app, self.allowed, self.max_header_bytes = app, allowed, max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        refusal = self._why(scope)
        if refusal is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # none is served; close before accepting
            await send({"type": "websocket.close", "code": 1008})
            return
        status, code, message = refusal
        headers, body = error_body(code, message)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _why(self, scope: Scope) -> tuple[int, str, str] | None:
        """(status, code, message) of the refusal, or None: the request passes."""
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if size > self.max_header_bytes:
            return (
                431,
                "headers_too_large",
                f"the request line and headers pass {self.max_header_bytes} bytes ([limits] max_header_bytes)",
            )
        if self.allowed is not None:
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if host_name(host) not in self.allowed:
                return (
                    400,
                    "invalid_host",
                    "this server does not answer to that Host header; an operator can "
                    "add the name to allowed_hosts (docs/server.md, Behind a proxy)",
                )
        return None


def media_type_error(content_type: str | None) -> str | None:
    """Why a body's Content-Type is not ``application/json`` (parameters such as charset allowed); None: it is."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind == "application/json":
        return None
    shown = quoted(kind) if kind else "none"
    return f"the request body must be JSON sent as 'Content-Type: application/json' (got {shown})"


_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()]+")
_PATH = re.compile(r"(?<![\w.-])(?:~|[A-Za-z]:)?(?:[/\\][^\s/\\'\"<>:,;()]+){2,}[/\\]?")
_TRACEBACK = "Traceback (most recent call last)"
REDACT_CHARS = 2000  # longer internal texts are cut: no client needs more, and the log has it all


def redact(text: str) -> str:
    """`text` without file paths, URLs and tracebacks (each replaced by a placeholder), cut short."""
    text = text.split(_TRACEBACK, 1)[0][:REDACT_CHARS]
    return _PATH.sub("<path>", _URL.sub("<url>", text))


def quoted(value: str, limit: int = 64) -> str:
    """A client's string for a log line: quoted and escaped (no forged lines), at most `limit` characters."""
    return repr(value[:limit]) + ("…" if len(value) > limit else "")


__all__ = ["Gate", "error_body", "host_name", "media_type_error", "quoted", "redact"]
