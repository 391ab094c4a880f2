"""In Serve's proxy: a stream whose front-end replica died ends with the API's own error event.

Once a response has started, Serve's proxy sends nothing more when the replica behind it dies: the
client would see its stream cut without a word. :class:`EndStreams`, an ASGI middleware that runs in
the proxy (Serve calls :func:`middlewares`, named by the environment variable :data:`ENV`, when it
starts a proxy), watches each response; an event stream (``text/event-stream``) that was not finished
when the proxy is done with it ends with the error event the replica itself would have sent on a
failure: OpenAI's ``data: {"error": ...}`` then ``data: [DONE]`` (chat, text completions), Anthropic's
``event: error`` (Messages), the Responses API's ``error`` event (numbered after the last one sent).
The proxy knows a stream by its path only: the API's answer class that serves the path
(``Answer.serves``) says how its streams end (``Answer.cut_ending``).
"""

from __future__ import annotations

import logging
import re

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..answer import Answer
from ..chat.serving import ChatAnswer
from ..completions.serving import CompletionAnswer
from ..messages.serving import MessagesAnswer
from ..responses.serving import ResponsesAnswer
from ..serving import APIError

log = logging.getLogger("segfuse.server")
ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "segfuse.server.ray.streams:middlewares"
ANSWERS: tuple[type[Answer], ...] = (ChatAnswer, CompletionAnswer, MessagesAnswer, ResponsesAnswer)
SEQUENCE = re.compile(rb'"sequence_number": (\d+)')


def lost() -> APIError:
    return APIError(
        502,
        "the front-end replica serving this stream stopped before the answer ended (its process "
        "died); retry the request",
        "server_error",
        "replica_lost",
    )


def answer_for(path: str) -> type[Answer]:
    """The answer class whose streams `path` serves (another path: OpenAI's ending, the base's)."""
    return next((answer for answer in ANSWERS if answer.serves(path)), Answer)


def ending(path: str, last_sequence: int | None) -> bytes:
    """The frames that end an unfinished stream of the API at `path`."""
    return answer_for(path).cut_ending(lost(), last_sequence).encode()


class _Watch:
    """What a response has sent so far."""

    def __init__(self) -> None:
        self.events = self.finished = self.gone = False  # gone: the client hung up
        self.whole = True  # the last body part ended a frame
        self.sequence: int | None = None

    def note(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or [])
            self.events = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                self.whole = body.endswith(b"\n\n")
                numbers = SEQUENCE.findall(body)
                if numbers:
                    self.sequence = int(numbers[-1])
            self.finished = not message.get("more_body", False)

    @property
    def unfinished(self) -> bool:
        return self.events and not self.finished and not self.gone


class EndStreams:
    """ASGI middleware (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        watch = _Watch()

        async def watched(message: Message) -> None:
            watch.note(message)
            await send(message)

        async def received() -> Message:
            message = await receive()
            watch.gone = watch.gone or message["type"] == "http.disconnect"
            return message

        try:
            await self.app(scope, received, watched)
        except Exception:
            if not watch.unfinished:
                raise
            log.exception("a stream on %s broke", scope.get("path"))
        if watch.unfinished:
            log.warning(
                "a stream on %s ended unfinished (its replica died): ending it with an error event", scope.get("path")
            )
            body = (b"" if watch.whole else b"\n\n") + ending(scope.get("path", ""), watch.sequence)
            await send({"type": "http.response.body", "body": body, "more_body": False})


def middlewares() -> list[Middleware]:
    """What Serve's proxy adds (:data:`ENV` names this function)."""
    return [Middleware(EndStreams)]


__all__ = ["ANSWERS", "CALLBACK", "ENV", "EndStreams", "answer_for", "ending", "middlewares"]
