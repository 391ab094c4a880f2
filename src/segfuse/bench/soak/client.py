"""The soak's client: sends one planned request and says how it ended (a ``Record``).

Chat completions go through the real ``openai`` client, without retries (a
retry would be a duplicated request); malformed and hostile ones through raw
``httpx``, since the ``openai`` client cannot send them. Clients that hang up close their
response, which closes the connection, as a vanished client would.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai

from .accounting import Record
from .traffic import HOSTILE, KINDS, MALFORMED, STREAMED, Action, malformed_body, messages


class SoakClient:
    """Sends actions to one server; thread-safe (one ``openai`` and one ``httpx`` client, shared)."""

    def __init__(
        self, url: str, api_key: str, *, n_ctx: int, max_body_bytes: int, t0: float, request_timeout_s: float = 600.0
    ) -> None:
        self.url, self.api_key, self.n_ctx, self.max_body_bytes, self.t0 = url, api_key, n_ctx, max_body_bytes, t0
        self.openai = openai.OpenAI(
            base_url=f"{url}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=openai.Timeout(request_timeout_s, connect=10.0),
        )
        self.http = httpx.Client(base_url=url, timeout=httpx.Timeout(60.0, connect=10.0))

    def close(self) -> None:
        self.openai.close()
        self.http.close()

    def send(self, action: Action) -> Record:
        """Run `action` to its end; never raises (an error is an outcome)."""
        start = time.monotonic()
        record = Record.of(action, start - self.t0, 0.0, "unexpected", tuple(sorted(KINDS[action.kind].expected)))
        try:
            if action.kind == "malformed":
                self._malformed(action, record)
            elif action.kind == "hostile":
                self._hostile(action, record)
            elif action.kind in STREAMED:
                self._stream(action, record, start)
            else:
                self._complete(action, record)
        except openai.APITimeoutError:  # planned for "timeout"; for any other kind no answer came in time
            record.outcome = "abandoned" if action.kind == "timeout" else "lost"
            record.detail = "client time-out"
        except openai.APIStatusError as exc:
            record.status, record.code = exc.status_code, _code(exc)
            record.outcome = _error_outcome(exc.status_code, record.code)
            record.detail = str(exc.message)[:200]
        except openai.APIError as exc:  # an error event in a stream (no status), or a broken connection
            record.code = _code(exc)
            record.outcome = "failed" if record.code == "member_failed" else "unexpected"
            record.detail = f"{type(exc).__name__}: {str(exc)[:200]}"
        except Exception as exc:  # a finding, not the end of the run
            record.detail = f"{type(exc).__name__}: {str(exc)[:200]}"
        record.latency_s = time.monotonic() - start
        return record

    def _request(self, action: Action) -> dict[str, Any]:
        return {
            "model": "segfuse",
            "messages": messages(action, self.n_ctx),
            "max_tokens": action.max_tokens,
            "temperature": action.temperature,
            "seed": action.seed,
            "user": f"soak-{action.index}",
        }

    def _complete(self, action: Action, record: Record) -> None:
        client = self.openai if action.timeout_s is None else self.openai.with_options(timeout=action.timeout_s)
        answer = client.chat.completions.create(**self._request(action))
        text = (answer.choices[0].message.content or "") if answer.choices else ""
        record.status, record.response_id = 200, answer.id
        record.tokens = answer.usage.completion_tokens if answer.usage else None
        record.text_chars, record.finishes = len(text), 1
        record.outcome = "answered" if text else "empty"

    def _stream(self, action: Action, record: Record, start: float) -> None:
        hang_up = {"drop_first": "first", "drop_mid": "text"}.get(action.kind)
        stream = self.openai.chat.completions.create(
            **self._request(action), stream=True, stream_options={"include_usage": True}
        )
        record.status = 200
        try:
            for chunk in stream:
                record.response_id = record.response_id or chunk.id
                if hang_up == "first":
                    record.outcome = "abandoned"
                    return
                if chunk.usage is not None:
                    record.tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    text = choice.delta.content if choice.delta is not None else None
                    if text:
                        record.text_chars += len(text)
                        record.ttfs_s = record.ttfs_s if record.ttfs_s is not None else time.monotonic() - start
                        if hang_up == "text":
                            record.outcome = "abandoned"
                            return
                    record.finishes += choice.finish_reason is not None
        finally:
            stream.close()  # before the end: the connection closes, as when a client vanishes
        record.outcome = "answered" if record.text_chars and record.finishes else "empty"
        if not record.finishes:
            record.detail = "the stream ended without a finish chunk"

    def _malformed(self, action: Action, record: Record) -> None:
        m = MALFORMED[action.prompt]
        headers = {"Content-Type": "application/json", **m.headers}
        if m.key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        response = self.http.request(m.method, m.path, content=malformed_body(m, self.max_body_bytes), headers=headers)
        record.status, error = response.status_code, _error(response)
        record.code, param = error.get("code"), error.get("param")
        right = (record.status, record.code) == (m.status, m.code) and (m.param is None or param == m.param)
        record.outcome = "refused" if right else "unexpected"
        record.detail = (
            m.name
            if right
            else (f"{m.name}: expected {m.status} {m.code}{f' naming {m.param}' if m.param else ''}, got param {param}")
        )

    def _hostile(self, action: Action, record: Record) -> None:
        h = HOSTILE[action.prompt]
        record.expected = tuple(sorted(h.outcomes))
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}", **h.headers}
        response = self.http.post(h.path, content=h.body(), headers=headers)
        record.status, record.code = response.status_code, _error(response).get("code")
        if response.status_code == 200:
            body = response.json()
            message = (body.get("choices") or [{}])[0]
            text = (message.get("message") or {}).get("content") or message.get("text") or ""
            record.response_id, record.finishes = body.get("id"), 1
            record.tokens = (body.get("usage") or {}).get("completion_tokens")
            # An answer may be empty here (a forced EOS, a schema's first token): it still ended once.
            record.text_chars, record.outcome = len(text), "answered"
        elif record.status in h.statuses and record.code != "invalid_request":  # the members' 400 is "invalid"
            record.outcome = "refused"
        else:
            record.outcome = _error_outcome(record.status, record.code)
        record.detail = (
            h.name
            if record.outcome in h.outcomes
            else (f"{h.name}: {record.status} {record.code} {response.text[:160]}")
        )


def _error(response: httpx.Response) -> dict[str, Any]:
    """The error object of an error body ({} for anything else)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _code(exc: openai.APIError) -> str | None:
    code = getattr(exc, "code", None)
    if code is None and isinstance(exc.body, dict):
        code = exc.body.get("code") or (exc.body.get("error") or {}).get("code")
    return code


def _error_outcome(status: int, code: str | None) -> str:
    if status == 429:
        return "rejected"
    if status == 400 and code == "invalid_request":
        return "invalid"
    if status == 500 and code == "member_failed":
        return "failed"
    return "unexpected"
