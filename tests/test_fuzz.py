"""A property-based fuzz of the server's requests: thousands of generated requests against one live server.

Strategies (hypothesis) are built over the request models in ``server/chat/protocol.py`` and
``server/completions/protocol.py``, field by field (a test checks that every field of those models has a
strategy, so a new field is fuzzed as soon as it exists), plus the server's tables of tolerated and
neutral parameters, the fusion options, and deliberately broken variants: wrong types, non-finite
numbers, lone surrogates, bad tools and schemas, raw bytes, other methods, paths, headers and keys.

Every request goes through real HTTP on loopback to a real ``segfuse serve`` with the embedded
members. The properties, for each request:

- an answer comes (no hang: a client time-out is a failure) and it is never a 5xx;
- a refusal is OpenAI's error JSON with a message; an answer validates against the response models
  (a stream: chunks that validate, no error frame, ``[DONE]`` at the end);

and after every batch of ``BATCH`` requests the server answers a normal greedy request with the same
text as before the fuzz, with nothing held (/health: queue empty, every slot free, no KV-cache cell).

Generated requests are cheap: most are refused; answers are 1-2 tokens (the server's default too).
Settings are derandomized, so CI sends the same requests every run; no shrinking (a failure is
reported with its request, the response and the server's traceback instead).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers import API_KEY, wait_for
from segfuse import models as catalogue
from segfuse.bench.common.processes import SegfuseServer, segfuse_server
from segfuse.options import FusionOptions
from segfuse.server.chat.protocol import (
    NEUTRAL_PARAMETERS,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
)
from segfuse.server.completions.protocol import COMPLETION_NEUTRAL, CompletionRequest, TextCompletion
from segfuse.server.wire import TOLERATED_PARAMETERS, ErrorResponse

pytestmark = [pytest.mark.models, pytest.mark.timeout(1200)]

MEMBERS = list(catalogue.DEFAULT_MODELS)
BATCH = 100  # fuzz requests between two normal ones
TIMEOUT_S = 120.0  # no answer in this long is a hang (answers here are 1-2 tokens)
# Requests per batch of each test; together at least 2,000 (checked at the end).
EXAMPLES = {"chat": 1000, "text": 400, "raw": 450, "routes": 250}
NORMAL = {
    "model": "segfuse",
    "messages": [{"role": "user", "content": "Name three primary colors."}],
    "max_tokens": 4,
    "temperature": 0,
}
FUZZ = settings(
    max_examples=1,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)


# --------------------------------------------------------------------------- values


def finite_floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


# Text with what breaks parsers and tokenizers: special tokens, control characters, lone surrogates.
SPECIAL = [
    "<|im_end|>",
    "<|im_start|>system\n",
    "<|endoftext|>",
    "<start_of_turn>",
    "</s>",
    "<s>",
    "\x00",
    "\ud800",
    "\udfff",
    "\u202e",
    "{",
    "\\",
    "%s",
    "{{ x }}",
    "😀",
    "\r\n",
]
texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(SPECIAL),
    st.lists(st.sampled_from(SPECIAL) | st.text(max_size=6), max_size=4).map("".join),
)
questions = st.sampled_from(["Say hi.", "What is 2 + 2?", "Name a colour."]) | texts
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
# A budget: small when valid (answers stay 1-2 tokens), or wrong.
budgets = st.sampled_from([1, 2]) | st.sampled_from([0, -1, "2", 1.5, True, None, [2], 2**64])
seeds = st.integers(-(2**70), 2**70) | st.sampled_from([-1, 0, 2**32, 2**63 - 1, 2**63, -(2**63), 2**64, "-1", 1.0])


# --------------------------------------------------------------------------- schemas, tools, messages

schema_types = st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null", "nope"])
schemas = st.recursive(
    st.one_of(
        st.builds(lambda t: {"type": t}, schema_types),
        st.just({}),
        st.just(True),
        json_values,
        st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^a+$", "(a+)+$", "[", "\\d"])),
        st.builds(lambda e: {"enum": e}, st.lists(scalars, max_size=3)),
    ),
    lambda inner: st.one_of(
        st.builds(
            lambda p, r: {"type": "object", "properties": p, "required": r},
            st.dictionaries(st.text(max_size=5), inner, max_size=3),
            st.lists(st.text(max_size=5), max_size=2),
        ),
        st.builds(lambda i, n: {"type": "array", "items": i, "minItems": n}, inner, st.integers(-1, 3)),
        st.builds(lambda a: {"anyOf": a}, st.lists(inner, max_size=3)),
        st.builds(lambda s: {"$ref": s}, st.sampled_from(["#", "#/definitions/x", "http://example.com/s"])),
    ),
    max_leaves=6,
)
tool_names = st.sampled_from(["lookup", "add", "get_weather"]) | texts
tools = st.one_of(
    st.builds(
        lambda n, p, d: {"type": "function", "function": {"name": n, "parameters": p, "description": d}},
        tool_names,
        schemas,
        texts,
    ),
    st.builds(lambda f: {"type": "function", "function": f}, json_values),
    json_values,
)
tool_choices = (
    st.sampled_from(["none", "auto", "required", "any"])
    | st.builds(lambda n: {"type": "function", "function": {"name": n}}, tool_names)
    | json_values
)
response_formats = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "yaml"}]),
    st.builds(
        lambda s, n: {"type": "json_schema", "json_schema": {"name": n, "schema": s, "strict": True}}, schemas, texts
    ),
    json_values,
)
tool_calls = st.lists(
    st.one_of(
        st.builds(
            lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
            texts | json_values,
            tool_names | json_values,
            st.just("{}") | texts | json_values,
        ),
        json_values,
    ),
    max_size=2,
)
parts = st.lists(
    st.builds(lambda t: {"type": "text", "text": t}, texts)
    | st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, texts)
    | json_values,
    max_size=3,
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | st.sampled_from(
    ["function", "", "USER"]
)


@st.composite
def message(draw: st.DrawFn, role: Any = None) -> Any:
    if draw(st.integers(0, 15)) == 0:
        return draw(json_values)  # not a message at all
    m: dict[str, Any] = {"role": role if role is not None else draw(roles)}
    m["content"] = draw(st.one_of(questions, parts, st.none(), json_values)) if draw(st.booleans()) else draw(questions)
    for name, values in (
        ("name", texts | json_values),
        ("tool_calls", tool_calls),
        ("tool_call_id", texts | json_values),
    ):
        if draw(st.integers(0, 5)) == 0:
            m[name] = draw(values)
    return m


@st.composite
def conversations(draw: st.DrawFn) -> Any:
    """Mostly earlier turns then the user's question, sometimes an assistant's prefill to continue after it;
    sometimes anything."""
    if draw(st.integers(0, 20)) == 0:
        return draw(json_values)
    earlier = draw(st.lists(message(), max_size=3))
    prefill = [draw(message("assistant"))] if draw(st.integers(0, 4)) == 0 else []
    return [*earlier, draw(message("user")), *prefill]


# --------------------------------------------------------------------------- request bodies

OPTION_VALUES = {  # fusion options: small answers when valid; every type of wrong
    "max_tokens": budgets,
    "window": st.integers(-2, 300) | json_values,
    "stop": st.lists(texts, max_size=20) | texts | json_values,
    "hedge_eta": st.sampled_from([1e308, 1.0, 0.0, -1.0, math.inf]) | json_values,
}


def option_values(name: str) -> st.SearchStrategy[Any]:
    annotation = str(FusionOptions.model_fields[name].annotation)
    typed = (
        st.booleans()
        if "bool" in annotation
        else st.integers(-3, 400)
        if "int" in annotation
        else st.floats()
        if "float" in annotation
        else texts
    )
    return OPTION_VALUES.get(name, typed | json_values)


fusion_options = st.lists(
    st.sampled_from(sorted(FusionOptions.model_fields)) | st.text(max_size=8), max_size=3, unique=True
).flatmap(
    lambda names: st.fixed_dictionaries(
        {k: option_values(k) if k in FusionOptions.model_fields else json_values for k in names}
    )
)

SHARED = {  # GenerationRequest's fields, chat and text alike
    "model": st.sampled_from(["segfuse", *MEMBERS]) | texts | json_values,
    "max_tokens": budgets,
    "temperature": finite_floats(-1, 3) | st.floats() | json_values,
    "top_p": finite_floats(-0.5, 1.5) | st.floats() | json_values,
    "seed": seeds | json_values,
    "stop": st.lists(texts, max_size=20) | texts | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.builds(lambda b: {"include_usage": b}, st.booleans() | json_values) | json_values,
    "user": texts | json_values,
    "n": st.sampled_from([1, 2, 0, -1]) | json_values,
    "cache_salt": st.sampled_from(["a", "tenant-1", "", "x" * 300]) | texts | json_values,
    "segfuse": fusion_options | json_values,
    # Never 0: it frees the members after the answer, and reloading them for many requests would make the
    # batch minutes longer (tests/test_on_demand.py frees and reloads them).
    "keep_alive": (st.sampled_from(["5m", "-1", -1, "1h30m", 30, 2.5, "soon", "", "1e9"]) | json_values).filter(
        lambda v: not (isinstance(v, int | float) and v == 0)
    ),
}
CHAT_FIELDS = {
    **SHARED,
    "messages": st.deferred(conversations),
    "max_completion_tokens": budgets,
    "tools": st.lists(tools, max_size=3) | json_values,
    "tool_choice": tool_choices,
    "response_format": response_formats,
    "logprobs": st.booleans() | json_values,
    "top_logprobs": st.integers(-1, 25) | json_values,
    "continue_final_message": st.booleans() | json_values,
    "add_generation_prompt": st.booleans() | json_values,
}
TEXT_FIELDS = {
    **SHARED,
    "prompt": st.one_of(
        questions,
        st.lists(questions, max_size=3),
        st.lists(st.integers(-5, 200000), max_size=4),
        st.just([]),
        st.lists(questions, min_size=17, max_size=17),
        json_values,
    ),
    "echo": st.booleans() | json_values,
    "logprobs": st.integers(-1, 7) | json_values,
}


def others(neutral: dict[str, tuple[Any, ...]]) -> st.SearchStrategy[dict[str, Any]]:
    """Parameters outside the models: tolerated, neutral (at their neutral value or not), fusion options at
    the top level, unknown names."""
    names = st.sampled_from(sorted({*TOLERATED_PARAMETERS, *neutral, *FusionOptions.model_fields}))
    pairs = (
        st.tuples(names, json_values)
        | st.tuples(st.sampled_from(sorted(neutral)), st.none())
        | st.sampled_from([(k, v) for k, values in neutral.items() for v in values])
        | st.tuples(st.text(max_size=10), json_values)
    )
    return st.lists(pairs, max_size=2).map(dict)


@st.composite
def bodies(
    draw: st.DrawFn,
    fields: dict[str, st.SearchStrategy[Any]],
    base: dict[str, st.SearchStrategy[Any]],
    neutral: dict[str, tuple[Any, ...]],
) -> dict[str, Any]:
    """A valid core (`base`), a few fields drawn over it, sometimes extra parameters or a field left out."""
    body = {name: draw(strategy) for name, strategy in base.items()}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 3)) == 0:
        body.update(draw(others(neutral)))
    if draw(st.integers(0, 15)) == 0:
        body.pop(draw(st.sampled_from(sorted(base))), None)
    return body


chat_bodies = bodies(
    CHAT_FIELDS, {"messages": conversations(), "max_tokens": st.sampled_from([1, 2])}, NEUTRAL_PARAMETERS
)
text_bodies = bodies(TEXT_FIELDS, {"prompt": questions, "max_tokens": st.sampled_from([1, 2])}, COMPLETION_NEUTRAL)


# --------------------------------------------------------------------------- raw requests


@dataclass
class Request:
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    key: str | None = f"Bearer {API_KEY}"  # the Authorization header

    def brief(self) -> str:
        body = (self.body or b"")[:600].decode("utf-8", "backslashreplace")
        return f"{self.method} {self.path} headers={self.headers} authorization={(self.key or '')[:40]!r} body={body}"


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity as Python writes them: the server's json reads them


def deep(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


raw_payloads = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda b, n: encode(b)[:n], chat_bodies, st.integers(0, 80)),  # truncated
    st.builds(encode, json_values),
    st.builds(deep, st.sampled_from([10, 100, 1000, 5000, 30000])),
    st.sampled_from(
        [
            b"",
            b"null",
            b"{}",
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}',
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "max_tokens": 1}',
            b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}',
            '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'.encode("utf-16"),
        ]
    ),
)
content_types = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
        "",
        "application/jsonx",
        "APPLICATION/JSON",
    ]
)
BEARER = f"Bearer {API_KEY}"
keys = st.sampled_from(
    [
        BEARER,
        None,
        "Bearer wrong",
        f"bearer {API_KEY}",
        f"Basic {API_KEY}",
        f"Bearer  {API_KEY}",
        API_KEY,
        "Bearer " + "x" * 5000,
        f"{BEARER}x",
        f"Bearer {API_KEY[:-1]}",
    ]
)


@st.composite
def raw_requests(draw: st.DrawFn) -> Request:
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    body = draw(st.one_of(raw_payloads, st.builds(encode, chat_bodies if "chat" in path else text_bodies)))
    headers = {"Content-Type": draw(content_types)}
    if draw(st.integers(0, 9)) == 0:
        headers["Host"] = draw(st.sampled_from(["attacker.example", "localhost", "127.0.0.1:1", "[::1]", ""]))
    key = draw(keys) if draw(st.integers(0, 4)) == 0 else BEARER
    method = draw(st.sampled_from(["POST"] * 6 + ["PUT", "PATCH", "DELETE", "GET"]))
    return Request(method, path, body, headers, key)


path_texts = st.text(st.characters(min_codepoint=32, max_codepoint=126, exclude_characters="?#"), max_size=20)


@st.composite
def route_requests(draw: st.DrawFn) -> Request:
    """The other routes: models by any id, the tokenizer's, health, metrics, the web view, static files,
    unknown paths."""
    path = draw(
        st.one_of(
            st.builds(lambda m: f"/v1/models/{m}", st.sampled_from(["segfuse", *MEMBERS]) | path_texts),
            st.sampled_from(
                [
                    "/tokenize",
                    "/detokenize",
                    "/tokenizer_info",
                    f"/m/{MEMBERS[0]}/tokenize",
                    f"/m/{MEMBERS[0]}/v1/completions",
                ]
            ),
            st.builds(lambda m: f"/m/{m}/tokenizer_info", st.sampled_from(["segfuse", *MEMBERS]) | path_texts),
            st.sampled_from(
                [
                    "/v1/models",
                    "/health",
                    "/metrics",
                    "/",
                    "/openapi.json",
                    "/static/index.html",
                    "/static/../../../../etc/passwd",
                    "/static/..%2f..%2f..%2fetc%2fpasswd",
                    "/v1",
                    "/v2/x",
                ]
            ),
            st.builds(lambda p: f"/static/{p}", path_texts),
            st.builds(lambda p: f"/v1/{p}", path_texts),
        )
    )
    method = draw(st.sampled_from(["GET"] * 5 + ["POST", "HEAD", "OPTIONS", "DELETE"]))
    body = draw(st.none() | raw_payloads) if method == "POST" else None
    return Request(method, path, body, {"Content-Type": "application/json"}, draw(keys))


# --------------------------------------------------------------------------- the live server and the properties


class Wedged(Exception):
    """No answer in time: the server hangs."""


@dataclass
class Fuzz:
    """One live server, the requests sent to it, and what went wrong."""

    server: SegfuseServer
    http: httpx.Client
    baseline: str = ""
    sent: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # of the batch under way
    unsendable: Counter[str] = field(default_factory=Counter)
    batches: list[str] = field(default_factory=list)
    _log_offset: int = 0

    def send(self, request: Request, batch: str) -> None:
        """Send one fuzz request and check it; every BATCH requests, check the server with a normal one."""
        headers = dict(request.headers)
        if request.key is not None:
            headers["Authorization"] = request.key
        self.sent[batch] += 1
        try:
            with self.http.stream(request.method, request.path, content=request.body, headers=headers) as response:
                raw = response.read()
        except httpx.TimeoutException:
            self.failures.append(f"hang: no answer in {TIMEOUT_S:.0f} s to {request.brief()}")
            raise Wedged(self.failures[-1]) from None
        except (httpx.LocalProtocolError, httpx.UnsupportedProtocol, httpx.InvalidURL):
            self.sent[batch] -= 1  # a request the client cannot send: not the server's doing
            self.unsendable[batch] += 1
            return
        except httpx.TransportError as exc:
            self.failures.append(
                f"the connection broke ({type(exc).__name__}: {exc})\n  request: {request.brief()}{self.tracebacks()}"
            )
            return
        self.statuses[response.status_code] += 1
        problem = self.judge(request, response, raw)
        if problem:
            self.failures.append(
                f"{problem}\n  request: {request.brief()}\n  response: {response.status_code} "
                f"{raw[:400]!r}{self.tracebacks()}"
            )
        if self.sent[batch] % BATCH == 0:
            self.after_batch(f"{batch} request {self.sent[batch]}")

    def judge(self, request: Request, response: httpx.Response, raw: bytes) -> str | None:
        status = response.status_code
        if status >= 500:
            return f"answered {status}"
        if request.method == "HEAD" or status in (204, 304):
            return None
        if b"root:" in raw and "passwd" in request.path:
            return "a file outside the static folder was served"
        if 400 <= status < 500:
            if response.headers.get("content-type", "").startswith("text/plain") and "Host" in request.headers:
                return None  # a refused Host header: before the app, in plain text
            try:
                ErrorResponse.model_validate_json(raw)
            except ValueError as exc:
                return f"a {status} that is not OpenAI's error JSON: {exc}"
            return None
        if request.method == "POST" and request.path in ("/v1/chat/completions", "/v1/completions"):
            try:
                return self.judge_answer(request, response, raw)
            except ValueError as exc:  # a frame that is not JSON, or a chunk that does not validate
                return f"a 200 whose stream does not parse: {exc}"
        return None

    @staticmethod
    def judge_answer(request: Request, response: httpx.Response, raw: bytes) -> str | None:
        chat = request.path == "/v1/chat/completions"
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            frames = [
                line[len("data: ") :]
                for line in raw.decode("utf-8", "replace").splitlines()
                if line.startswith("data: ")
            ]
            if not frames or frames[-1] != "[DONE]":
                return "a stream without [DONE] at its end"
            for frame in frames[:-1]:
                data = json.loads(frame)
                if "error" in data:
                    return f"an error frame in a stream: {frame[:300]}"
                if chat:
                    ChatCompletionChunk.model_validate(data)
                else:
                    TextCompletion.model_validate(data)
            return None
        try:
            (ChatCompletion if chat else TextCompletion).model_validate_json(raw)
        except ValueError as exc:
            return f"a 200 that is not a completion: {exc}"
        return None

    def tracebacks(self) -> str:
        """Tracebacks the server logged since the last look."""
        text = self.server.log.read_text(errors="replace")
        new, self._log_offset = text[self._log_offset :], len(text)
        found = re.findall(r"Traceback \(most recent call last\):.*?(?=\n\S+ (?:INFO|ERROR|WARNING)|\Z)", new, re.S)
        return "".join(f"\n  server traceback:\n{t[-2500:]}" for t in found[:1])

    def normal(self) -> str:
        response = self.http.post("/v1/chat/completions", json=NORMAL, headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 200, response.text
        return ChatCompletion.model_validate_json(response.content).choices[0].message.content or ""

    def idle(self) -> dict[str, Any]:
        health = self.http.get("/health", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        return (
            health
            if (
                not health["queue"]["waiting"]
                and not health["queue"]["running"]
                and all(
                    o["free_slots"] == o["slots"] and not o["cache_cells"] and not o["stray_cells"]
                    for o in health["occupancy"].values()
                )
            )
            else {}
        )

    def after_batch(self, label: str) -> None:
        """The server still answers a normal request, the same as before, and holds nothing when idle."""
        try:
            text = self.normal()
        except httpx.TimeoutException:
            self.failures.append(f"hang: the normal request after {label} got no answer in {TIMEOUT_S:.0f} s")
            raise Wedged(self.failures[-1]) from None
        if text != self.baseline:
            self.failures.append(
                f"after {label} the normal request answered {text!r}, before the fuzz {self.baseline!r}"
            )
        try:
            wait_for(self.idle, 60, what="an idle server")
        except AssertionError:
            health = self.http.get("/health", headers={"Authorization": f"Bearer {API_KEY}"}).json()
            self.failures.append(
                f"after {label} the server holds something: queue {health['queue']}, occupancy {health['occupancy']}"
            )

    def check(self, batch: str) -> None:
        """The batch's end: a last normal request, then every failure seen so far, reported."""
        self.after_batch(f"the {batch} batch")
        self.batches.append(batch)
        failures, self.failures = self.failures, []
        if failures:
            shown = "\n\n".join(failures[:6])
            pytest.fail(f"{len(failures)} failures in {self.sent[batch]} {batch} requests:\n\n{shown}", pytrace=False)


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory) -> Iterator[Fuzz]:
    missing = [n for n in MEMBERS if not catalogue.is_ready(catalogue.CATALOGUE[n])]
    if missing:
        pytest.fail(f"models not prepared: {missing}; run `make models`", pytrace=False)
    config = {
        "server": {"api_key": API_KEY, "queue_size": 8, "max_concurrent": 2, "max_body_bytes": 65536},
        "members": {"threads": 1, "n_ctx": 512},
        "defaults": {"max_tokens": 2},  # a request that sets no budget answers 1-2 tokens too
    }
    with (
        segfuse_server(tmp_path_factory.mktemp("fuzz"), "fuzz", config, startup_s=300) as server,
        httpx.Client(base_url=server.url, timeout=httpx.Timeout(TIMEOUT_S, connect=10)) as http,
    ):
        state = Fuzz(server, http)
        state.baseline = state.normal()
        assert state.baseline.strip()
        yield state
        print(
            f"\nfuzz: {sum(state.sent.values())} generated requests {dict(state.sent)}, "
            f"statuses {dict(sorted(state.statuses.items()))}, not sendable {dict(state.unsendable)}"
        )


def run_batch(fuzz: Fuzz, batch: str, requests: st.SearchStrategy[Request]) -> None:
    @settings(FUZZ, max_examples=EXAMPLES[batch])
    @given(requests)
    def one(request: Request) -> None:
        if fuzz.failures and fuzz.failures[-1].startswith("hang"):
            return  # the server hangs: the batch ends with that failure
        fuzz.send(request, batch)

    try:
        one()
    except Wedged:
        pass  # reported by check
    fuzz.check(batch)


def json_post(path: str) -> Any:
    return lambda body: Request("POST", path, encode(body), {"Content-Type": "application/json"})


# --------------------------------------------------------------------------- the batches


def test_every_field_of_the_request_models_has_a_strategy():
    assert set(ChatCompletionRequest.model_fields) == set(CHAT_FIELDS)
    assert set(CompletionRequest.model_fields) == set(TEXT_FIELDS)
    assert set(ChatMessage.model_fields) == {"role", "content", "name", "tool_calls", "tool_call_id"}


def test_fuzz_chat_completions(fuzz):
    run_batch(fuzz, "chat", chat_bodies.map(json_post("/v1/chat/completions")))


def test_fuzz_text_completions(fuzz):
    run_batch(fuzz, "text", text_bodies.map(json_post("/v1/completions")))


def test_fuzz_raw_bodies_headers_methods_and_keys(fuzz):
    run_batch(fuzz, "raw", raw_requests())


def test_fuzz_the_other_routes(fuzz):
    run_batch(fuzz, "routes", route_requests())


def test_the_fuzz_sent_at_least_2000_requests(fuzz):
    if set(fuzz.batches) != set(EXAMPLES):
        pytest.skip("only with every batch run")
    total = sum(fuzz.sent.values())
    assert total >= 2000, dict(fuzz.sent)
