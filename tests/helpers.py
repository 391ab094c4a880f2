"""Shared test helpers: wrappers around real members and sessions that record or alter what they do."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pydantic import BaseModel

from segfuse import models as catalogue
from segfuse.backends.base import Member, MemberSession
from segfuse.bench.common.processes import SegfuseServer, segfuse_server
from segfuse.types import Result


class SessionWrapper(MemberSession):
    """A real session behind a wrapper: every call passes through unless a subclass changes it."""

    def __init__(self, inner: MemberSession):
        self.inner = inner

    def draft(self, max_tokens, sampling):
        return self.inner.draft(max_tokens, sampling)

    def score(self, texts):
        return self.inner.score(texts)

    def accept(self, text):
        self.inner.accept(text)

    @property
    def stops(self):
        return self.inner.stops

    @property
    def room(self):
        return self.inner.room

    def counters(self):
        return self.inner.counters()

    def text_logprob(self, text):
        return self.inner.text_logprob(text)

    def close(self):
        self.inner.close()


def unwrap(session: MemberSession) -> MemberSession:
    return session.inner if isinstance(session, SessionWrapper) else session


class Wrapped(Member):
    """A real member behind a wrapper: everything it declares and does passes through."""

    def __init__(self, member: Member):
        self.member = member
        self.name = member.name
        self.capabilities = member.capabilities
        self.slots = member.slots
        self.n_params = member.n_params

    def new_session(self, messages, options):
        return self.member.new_session(messages, options)

    def prompt_tokens(self, messages):
        return self.member.prompt_tokens(messages)

    def draft_many(self, sessions, requests):
        return self.member.draft_many([unwrap(s) for s in sessions], requests)

    def score_many(self, sessions, requests):
        return self.member.score_many([unwrap(s) for s in sessions], requests)

    def close(self):
        pass  # the wrapped member belongs to whoever loaded it


class Recording(Wrapped):
    """Keeps the sessions it opens, for inspecting them after a run."""

    def __init__(self, member: Member):
        super().__init__(member)
        self.sessions = []

    def start(self, messages, *, seed, reserve):
        session = super().start(messages, seed=seed, reserve=reserve)
        self.sessions.append(session)
        return session


# --- servers on loopback ------------------------------------------------------------------

API_KEY = "test-key"
# Plain fusion: every member drafts and votes every round (no Model Exit, Hedge, gate, guard or accept margin).
PLAIN_FUSION = {"exit": False, "hedge": False, "gate": None, "guard": False, "accept_margin": None}
# A small JSON schema for structured output, and the response_format that asks for it.
PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
# The same kind of person as a pydantic model, for the frameworks' structured output, and a text that holds one.
EXTRACT = "Extract the person: Maria Lopez, aged 34, lives in Seville."


class Person(BaseModel):
    name: str
    age: int
    city: str


@contextmanager
def live_server(
    tmp: Path,
    *,
    queue_size: int = 8,
    max_body_bytes: int = 65536,
    max_concurrent: int = 2,
    startup_s: float = 180.0,
    prefix_cache_cells: int | None = None,
    extra_args: tuple[str, ...] = (),
) -> Iterator[SegfuseServer]:
    """A real `segfuse serve` with the default members, an API key, a small queue and body limit,
    running `max_concurrent` generations together (`prefix_cache_cells`: its bound; None, the default;
    `extra_args`: more `serve` flags)."""
    config = {
        "server": {
            "api_key": API_KEY,
            "queue_size": queue_size,
            "max_concurrent": max_concurrent,
            "max_body_bytes": max_body_bytes,
        },
        # One llama.cpp thread per member: on a busy 2-core machine, threads that spin-wait for
        # each other made rounds 3-6x slower than a single thread (measured: 3.0 vs 10.9-18.7 s
        # per 4-token request while other jobs ran).
        "members": {"threads": 1},
        "defaults": {"max_tokens": 16},
    }
    if prefix_cache_cells is not None:
        config["members"]["prefix_cache_cells"] = prefix_cache_cells
    with segfuse_server(tmp, "server", config, startup_s=startup_s, extra_args=extra_args) as server:
        yield server


@contextmanager
def checked_server(tmp: Path, **options) -> Iterator[SegfuseServer]:
    """`live_server` with the default members, failing clearly when they are not prepared; on leaving,
    no request made the server fail."""
    missing = [n for n in catalogue.DEFAULT_MODELS if not catalogue.is_ready(catalogue.CATALOGUE[n])]
    if missing:
        pytest.fail(f"models not prepared: {missing}; run `make models`", pytrace=False)
    with live_server(tmp, **options) as running:
        yield running
        assert running.health()["counters"]["failed"] == 0, running.log_tail()


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    """Poll until `predicate()` returns a truthy value; return it or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# --- greedy answers that kernel noise may part ------------------------------------------------

# Two greedy answers whose cells were computed in other batch shapes (a prefix read from a cache, other
# requests decoded beside it) may part where two tokens were all but tied: llama.cpp's quantized kernels then
# add in another order, which moved one token's log-probability by up to 0.32 nats here (Gemma-3-270M,
# tests/test_cache_reuse.py). The two leading tokens may each move that much, the opposite way: where the
# answers part, they must have been within twice that of each other in both answers, or it is no noise.
NEAR_TIE_NATS = 0.7
TOP_LOGPROBS = 3  # alternatives to ask for per token: the other answer's token must be among them

# The same texts scored from cells computed in other batch shapes: a likely token's probability moved by up to
# 0.07, an unlikely token's log-probability by up to 0.32 nats (Gemma-3-270M, tests/test_cache_reuse.py; a
# likely token's log-probability hardly moves, an unlikely one's probability hardly does). Each bound is about
# 1.5x and 3x those; a wrong cell (a token at the wrong position, another prompt's) moves the likely
# tokens' probabilities by far more.
SCORE_PROBABILITY, SCORE_NATS = 0.1, 1.0


def assert_scores_agree(first: list[float], second: list[float], what: object = "") -> tuple[float, float]:
    """Two scorings of the same tokens (log-probabilities) agree to kernel noise; returns how far apart they
    were at most: (probability, nats)."""
    assert len(first) == len(second), (what, first, second)
    probability = max((abs(math.exp(x) - math.exp(y)) for x, y in zip(first, second)), default=0.0)
    nats = max((abs(x - y) for x, y in zip(first, second)), default=0.0)
    assert probability <= SCORE_PROBABILITY and nats <= SCORE_NATS, (what, first, second)
    return probability, nats


def same_until_a_near_tie(a: Result, b: Result, near: float = NEAR_TIE_NATS) -> int:
    """How many leading tokens two greedy answers (asked with ``top_logprobs=TOP_LOGPROBS``) share; all of
    them when the texts are the same. Where they part, each answer's token and the other's were within
    `near` nats in both answers' alternatives; where one ended and the other went on, the one that went on
    had a runner-up within `near` there."""
    first, second = a.logprobs(), b.logprobs()
    for i, (x, y) in enumerate(zip(first, second)):
        if x.bytes != y.bytes:
            for own, other in ((x, y), (y, x)):
                alternatives = {piece: logprob for _, piece, logprob in own.top}
                assert other.bytes in alternatives, (i, own, other, a.text, b.text)
                assert own.logprob - alternatives[other.bytes] < near, (i, own, other, a.text, b.text)
            return i
    if len(first) != len(second):
        went_on = (first if len(first) > len(second) else second)[min(len(first), len(second))]
        assert len(went_on.top) > 1 and went_on.top[0][2] - went_on.top[1][2] < near, (went_on, a.text, b.text)
        return min(len(first), len(second))
    assert a.text == b.text
    return len(first)


def weather_agent_calls(model, max_tokens: int) -> list[str]:
    """A pydantic-ai agent over `model` with one tool, get_weather, asked for the weather in Paris: the cities
    it called its tool with. The run is cut after the request that follows the tool's result: an answer then,
    or another call that validated, both mean that request was served."""
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.usage import UsageLimits

    calls: list[str] = []
    agent = Agent(
        model, model_settings={"temperature": 0, "max_tokens": max_tokens}, system_prompt="Use the tools to answer."
    )

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 18 degrees and sunny in {city}."

    try:
        result = agent.run_sync("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=2))
        assert isinstance(result.output, str) and result.output  # it answered after the result
    except UsageLimitExceeded:
        pass  # it called again
    return calls
