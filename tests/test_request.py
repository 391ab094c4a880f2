"""One request, made once: what FusionRequest checks when it is made, the context the engine makes of it,
and that every way in validates a conversation once (the library, the server's chat and text completions)."""

from __future__ import annotations

import openai
import pytest

import segfuse.request
from fakes import ScriptedMember, ScriptedSession
from live_app import KEY, LEADER, live
from segfuse import Ensemble, FusionRequest
from segfuse.backends.base import Capabilities
from segfuse.constraints import Constraint
from segfuse.engine.context import GenerationContext
from segfuse.errors import InvalidRequestError
from segfuse.options import FusionOptions
from segfuse.types import Message

GREEDY = FusionOptions.build(temperature=0, max_tokens=4)


def test_a_request_checks_its_conversation_and_prefill_when_it_is_made():
    made = FusionRequest.of([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}], GREEDY)
    assert made.messages == (Message("user", "Hi"),)  # an empty prefill is dropped: nothing to continue
    for wrong, said in [
        ([{"role": "robot", "content": "Hi"}], "bad message"),
        ("", "the prompt is empty"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure "}], "ends with whitespace"),
    ]:
        with pytest.raises(InvalidRequestError, match=said):
            FusionRequest.of(wrong, GREEDY)
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]
    with pytest.raises(InvalidRequestError):  # not the start of a JSON object
        FusionRequest.of(prefill, GREEDY, constraint=Constraint.json_object())
    assert FusionRequest.of(prefill, GREEDY).messages[-1] == Message("assistant", "Sure")


def test_a_request_keeps_what_it_was_made_with():
    members, weights = ["a", "b"], {"a": 2.0, "b": 1.0}
    request = FusionRequest.of("Hi", GREEDY, members=members, weights=weights)
    members.append("c")
    weights["a"] = 9.0
    assert request.members == ("a", "b") and request.weights == {"a": 2.0, "b": 1.0}


def test_the_engine_reads_a_request_into_one_context():
    salted = FusionRequest.of(
        "Hi",
        FusionOptions.build(temperature=0, deterministic=True),
        top_logprobs=3,
        cache_salt="client-1",
        deadline=5.0,
        constraint=Constraint.json_object(),
    )
    context = GenerationContext.of(salted)
    assert context.sampling.top_logprobs == context.top_logprobs == 3 and context.sampling.temperature == 0
    assert context.start_options == {"cache_salt": "client-1", "deterministic": True}
    assert context.deadline == 5.0 and context.passed_deadline()  # 5 s after the monotonic clock's start
    free = ScriptedMember("remote", ScriptedSession([], {}))
    able = ScriptedMember("local", ScriptedSession([], {}), capabilities=Capabilities(constrained=True))
    assert context.drafts(able) and not context.drafts(free)  # under a constraint only those that can draft
    plain = GenerationContext.of(FusionRequest.of("Hi", GREEDY))
    assert plain.start_options == {} and plain.drafts(free) and plain.matcher is None and not plain.passed_deadline()


def test_a_request_made_already_takes_no_keywords():
    ensemble = Ensemble([ScriptedMember("a", factory=lambda messages: ScriptedSession([([b"Hi", b"."], True)], {}))])
    request = FusionRequest.of("Hi", GREEDY)
    with pytest.raises(InvalidRequestError, match="temperature given with a FusionRequest"):
        ensemble.generate(request, temperature=0.5)
    with pytest.raises(InvalidRequestError, match="json_object given with a FusionRequest"):
        ensemble.generate(request, json_object=True)
    assert ensemble.generate(request).text == ensemble.generate("Hi", options=GREEDY).text == "Hi."


@pytest.fixture()
def validations(monkeypatch):
    """How many times a conversation is validated (segfuse.request.to_messages checks each one)."""
    seen: list[int] = []
    check = segfuse.request.validate_messages

    def counted(messages):
        seen.append(len(messages))
        return check(messages)

    monkeypatch.setattr(segfuse.request, "validate_messages", counted)
    return seen


@pytest.mark.models
def test_every_way_in_validates_a_conversation_once(default_ensemble, validations):
    alone = default_ensemble.generate(FusionRequest.of("Say hi.", GREEDY, members=[LEADER]))
    assert alone.text and validations == [1]  # when it was made, not again when it ran
    assert default_ensemble.generate("Say hi.", max_tokens=4, temperature=0).text and validations == [1, 1]
    validations.clear()
    with live(default_ensemble) as server:
        client = openai.OpenAI(base_url=server.api, api_key=KEY, max_retries=0, timeout=300)
        chat = client.chat.completions.create(
            model=LEADER,
            max_tokens=4,
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        )
        assert chat.choices[0].message.content and validations == [2]  # one conversation of two messages
        validations.clear()
        text = client.completions.create(model=LEADER, max_tokens=4, prompt=["Once upon", "A cat"])
        assert len(text.choices) == 2 and validations == [1, 1]  # each prompt once
