"""The leader's text as it decodes it (leader alone): what goes out early is always kept, and the
joined stream is the answer, through the engine, the CLI's printer and the server's SSE."""

from __future__ import annotations

import io
import json
import random
import threading
from dataclasses import replace

import pytest

from segfuse.engine import drive
from segfuse.engine.live import Handoff
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.segments import apply_stops, before_stops, cut_draft, sure_prefix
from segfuse.types import DoneEvent, RoundEvent, SegmentEvent

# --- what may go out early: never more than the round's segment keeps ----------------------

PIECES = [
    "Hello",
    " world",
    ",",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n",
    " caf",
    "é",
    " 12",
    "3",
    ".",
    " The",
    "re",
    " x",
    "Question",
    ":",
    " Q",
    "\u00e9t\u00e9",
    " ",
    "!",
    "'s",
]


def _kept(pieces: list[str], finished: bool, answer: str, stops: tuple[str, ...]) -> str:
    """What the round's segment keeps of a whole draft (cut, then stop strings), as the engine cuts it."""
    cut = cut_draft([p.encode() for p in pieces], finished)
    return apply_stops(answer, cut.text, stops)[0]


@pytest.mark.parametrize("seed", range(40))
def test_sure_prefix_is_always_kept_however_the_draft_goes_on(seed):
    rng = random.Random(seed)
    stops = rng.choice([(), ("\n\n",), ("Question:",), (" Q", "!!")])
    answer = rng.choice(["", "Sure.", "One\n", "Question"])
    draft = [rng.choice(PIECES) for _ in range(rng.randint(1, 12))]
    for finished in (False, True):
        kept = _kept(draft, finished, answer, stops)
        for k in range(1, len(draft) + 1):
            sure = sure_prefix(draft[:k], answer, stops)
            assert kept.startswith(sure), (draft, k, sure, kept)
            # the hook sees two tokens at once where the second finishes a character (it starts inside
            # one, never with whitespace): still kept
            if k > 1 and draft[1][:1] not in (" ", "\t", "\n", "\r"):
                merged = ["".join(draft[:2]), *draft[2:k]]
                assert kept.startswith(sure_prefix(merged, answer, stops))


def test_a_handoff_never_lets_the_calling_thread_run_while_the_consumer_works():
    """The thread that decodes waits while each event is consumed: their work never overlaps."""
    handoff, timeline = Handoff(), []

    def decode() -> None:
        for i in range(5):
            timeline.append(("decode", i))
            handoff.give(i)  # type: ignore[arg-type]  # any object stands for an event here
        handoff.end()

    thread = threading.Thread(target=decode)
    thread.start()
    while (event := handoff.take()) is not None:
        timeline.append(("consume start", event))
        threading.Event().wait(0.01)  # the decoding thread would run on during this, without the handoff
        timeline.append(("consume end", event))
        handoff.taken()
    thread.join(5)
    assert not thread.is_alive()
    assert timeline == [step for i in range(5) for step in (("decode", i), ("consume start", i), ("consume end", i))]


def test_a_handoff_the_consumer_left_lets_the_calling_thread_finish():
    handoff = Handoff()
    thread = threading.Thread(target=lambda: [handoff.give(i) for i in range(3)])  # type: ignore[func-returns-value]  # the list is thrown away
    thread.start()
    assert handoff.take() == 0
    handoff.close()  # the consumer leaves without saying taken
    thread.join(5)
    assert not thread.is_alive()


def test_sure_prefix_holds_back_the_last_word_and_a_stop_strings_start():
    assert sure_prefix(["Hello", " wor"], "", ()) == "Hello"
    assert sure_prefix(["Hello", " world", "."], "", ()) == "Hello"  # "." may be followed by " More" + cut
    assert sure_prefix(["Hello", " world", ".", " The"], "", ()) == "Hello world."
    assert before_stops("", "The end.\nQuest", ("\nQuestion:",)) == "The end."
    assert before_stops("A\nQuestion", ":", ("\nQuestion:",)) == ""
    assert before_stops("", "ok STOP here", ("STOP",)) == "ok "


# --- through the engine, with the real members ----------------------------------------------

PROMPT = "In three short sentences, say why the sky is blue."


def _run(ensemble, live: bool, prompt: str = PROMPT, constraint=None, **options):
    opts = FusionOptions.build(**{"max_tokens": 24, "temperature": 0, **options})
    events = list(drive(ensemble.steps(FusionRequest.of(prompt, opts, constraint=constraint)), live=live))
    assert isinstance(events[-1], DoneEvent)
    return events, events[-1].result


def _texts(events) -> list[str]:
    return [e.segment.text for e in events if isinstance(e, SegmentEvent)]


@pytest.mark.models
@pytest.mark.parametrize("case", ["plain", "stop", "json"])
def test_leader_alone_streams_small_chunks_that_join_to_the_same_answer(uncached_ensemble, case):
    from segfuse.constraints import Constraint

    extra: dict = {}
    constraint = None
    prompt = PROMPT
    if case == "stop":
        extra = {"stop": ["."]}
    elif case == "json":
        prompt = "Give a JSON object with a name and an age for a person."
        constraint = Constraint.json_schema(
            {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            },
            where="test",
        )
    # No prefix cache: both answers read the prompt afresh, in the same cells (see the fixture).
    whole_events, whole = _run(uncached_ensemble, False, prompt, constraint, **extra)
    events, result = _run(uncached_ensemble, True, prompt, constraint, **extra)
    assert result.text == whole.text  # greedy: the same answer, streamed or not
    chunks = _texts(events)
    assert "".join(chunks) == result.text
    assert len(chunks) > len(result.rounds) >= 1  # smaller pieces than a round's segment
    assert any(e.partial for e in events if isinstance(e, SegmentEvent))
    assert not any(e.partial for e in whole_events if isinstance(e, SegmentEvent))
    assert all(d.decision in ("alone", "confident") for d in result.rounds)
    # every partial piece comes before its round's record
    seen_round = 0
    for e in events:
        if isinstance(e, RoundEvent):
            seen_round = e.record.index
        elif isinstance(e, SegmentEvent):
            assert e.segment.round == seen_round + 1
    if case == "stop":
        assert "." not in result.text and result.stats.finish_reason == "stop"
    if case == "json":
        assert set(json.loads(result.text)) == {"name", "age"}


@pytest.mark.models
def test_consulting_options_stream_whole_segments_as_before(default_ensemble):
    events, result = _run(default_ensemble, True, accept_margin=0.5)
    segments = [e for e in events if isinstance(e, SegmentEvent)]
    assert not any(e.partial for e in segments)
    assert [e.segment.text for e in segments] == [s.text for s in result.segments]


@pytest.mark.models
def test_the_cli_prints_the_leader_text_piece_by_piece(default_ensemble):
    from rich.console import Console

    from segfuse.cli import answer

    class Flushes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.pieces: list[str] = []
            self._at = 0

        def flush(self) -> None:
            text = self.getvalue()
            if len(text) > self._at:
                self.pieces.append(text[self._at :])
                self._at = len(text)

    sink = Flushes()
    previous = answer.out
    answer.out = Console(file=sink, force_terminal=False, width=10_000)
    try:
        opts = FusionOptions.build(max_tokens=24, temperature=0)
        result = answer.print_stream(default_ensemble.stream(PROMPT, options=opts), default_ensemble.names)
    finally:
        answer.out = previous
    assert "".join(sink.pieces) == result.text + "\n"  # the printer ends the answer's line
    assert len(sink.pieces) - 1 > len(result.rounds)


# --- through the server's SSE, with the openai client ----------------------------------------


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from openai import OpenAI

    from helpers import live_server

    # No prefix cache: two answers to one prompt read it afresh in the same cells, so greedy ones agree.
    with live_server(tmp_path_factory.mktemp("live"), max_concurrent=1, prefix_cache_cells=0) as server:
        with OpenAI(base_url=server.api, api_key=server.api_key, max_retries=0, timeout=300) as openai:
            yield openai
        assert server.health()["counters"]["failed"] == 0, server.log_tail()


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.models
@pytest.mark.parametrize("case", ["plain", "stop", "json_schema", "consulting"])
def test_the_server_streams_the_leader_text_in_small_chunks(client, case):
    ask: dict = {
        "model": "segfuse",
        "max_tokens": 24,
        "temperature": 0,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    if case == "stop":
        ask["stop"] = ["."]
    elif case == "json_schema":
        ask["messages"] = [{"role": "user", "content": "Give a JSON object with a name and an age for a person."}]
        ask["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    elif case == "consulting":
        ask["extra_body"] = {"segfuse": {"accept_margin": 0.5}}
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    answer = whole.choices[0].message.content
    assert "".join(pieces) == answer
    rounds = next(c for c in chunks if c.choices and c.choices[0].finish_reason).model_extra["segfuse"]["stats"]
    segments = whole.model_extra["segfuse"]["segments"]
    if case == "consulting":  # a vote may be held: whole segments, as before
        assert pieces == [s["text"] for s in segments]
    else:
        assert len(pieces) > rounds["rounds"] >= 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    if case == "stop":
        assert "." not in answer
    if case == "json_schema":
        assert set(json.loads(answer)) == {"name", "age"}


@pytest.mark.models
def test_text_a_failing_leader_sent_stays_and_its_successor_goes_on(default_ensemble):
    from helpers import SessionWrapper, Wrapped

    class FailsAfterWriting(SessionWrapper):
        """The leader writes its second draft (its text goes out), then its call fails."""

        streams_text = True

        def __init__(self, inner):
            super().__init__(inner)
            self.drafts = 0

        def draft(self, max_tokens, sampling, on_text=None):
            self.drafts += 1
            drafted = self.inner.draft(max_tokens, sampling, on_text)
            if self.drafts == 2:
                raise RuntimeError("the leader's server went away")
            return drafted

    class Leader(Wrapped):
        def __init__(self, member):
            super().__init__(member)
            self.capabilities = replace(member.capabilities, batched=False)  # draft() itself, not draft_many

        def start(self, messages, *, seed, reserve, **options):
            return FailsAfterWriting(self.member.start(messages, seed=seed, reserve=reserve, **options))

    members = [Leader(m) if m.name == "qwen2.5-coder-0.5b" else m for m in default_ensemble.members]
    from segfuse.engine import fusion_steps

    opts = FusionOptions.build(max_tokens=32, temperature=0)
    events = list(drive(fusion_steps(members, FusionRequest.of(PROMPT, opts))))
    result = events[-1].result
    assert [d.model for d in result.departures] == ["qwen2.5-coder-0.5b"]
    sent = [e.segment for e in events if isinstance(e, SegmentEvent)]
    assert "".join(s.text for s in sent) == result.text == "".join(s.text for s in result.segments)
    second = [s.text for s in sent if s.round == 2 and s.model == "qwen2.5-coder-0.5b"]
    assert second, "the failing leader's second draft went out in part"
    assert {s.model for s in result.segments if s.round >= 2} - {"qwen2.5-coder-0.5b"}  # a successor went on
