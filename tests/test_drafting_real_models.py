"""The members draft for the leader, on real models: every drafting mode answers as the leader alone,
token for token at temperature 0, through the engine, a constraint and the server
(docs/performance.md#drafting).

"Token for token" up to the kernels' rounding: llama.cpp's quantized CPU kernels round differently for a
batch of tokens (the drafts the leader reads) than for one (the leader writing alone), by up to about 0.1
in a logit, so where the leader's two likeliest tokens lie closer than that the two answers may part;
``helpers.same_until_a_near_tie`` checks that they part only there (as the prefix cache's tests do)."""

from __future__ import annotations

import json

import pytest

from helpers import TOP_LOGPROBS, same_until_a_near_tie
from segfuse.backends.registry import load_member
from segfuse.bench.serve.structured import object_schema
from segfuse.ensemble import Ensemble
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.types import Message, Sampling, SegmentEvent

pytestmark = pytest.mark.models

MODES = ("members", "lookup", "auto")
CODE_EDIT = (
    "Rename the variable `out` to `result` in this function; reply with the whole function only.\n\n"
    "```python\ndef evens(xs):\n    out = []\n    for x in xs:\n        if x % 2 == 0:\n"
    "            out.append(x)\n    return out\n```"
)
PROMPTS = [
    CODE_EDIT,
    "Write a Python function that returns the n-th Fibonacci number.",
    "Extract the name and age as JSON: 'Maria Lopez is a 34 year old engineer from Madrid.'",
    "Explain in two sentences why the sky is blue.",
]
PERSON = object_schema({"name": {"type": "string"}, "age": {"type": "integer"}})


def answer(ensemble, prompt, **options):
    options = {"temperature": 0, "max_tokens": 40, "top_logprobs": TOP_LOGPROBS, **options}
    events = list(ensemble.stream(prompt, **options))
    result = events[-1].result
    streamed = "".join(e.segment.text for e in events if isinstance(e, SegmentEvent))
    assert streamed == result.text  # what streamed is the answer, drafted rounds included
    return result


@pytest.fixture(scope="module")
def alone(uncached_ensemble):
    """The leader alone's greedy answer to each prompt (``draft="off"``, the default)."""
    return {p: answer(uncached_ensemble, p) for p in PROMPTS}


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_answers_as_the_leader_alone(uncached_ensemble, alone, mode):
    kept, identical = 0, 0
    for prompt in PROMPTS:
        result = answer(uncached_ensemble, prompt, draft=mode)
        same_until_a_near_tie(result, alone[prompt])
        identical += result.text == alone[prompt].text
        drafted = [r for r in result.rounds if r.decision == "drafted"]
        assert all(r.leader == "qwen2.5-coder-0.5b" and r.winner == r.leader for r in drafted)
        kept += sum(t["kept"] for t in result.stats.drafting.values())
    print(f"{mode}: {identical} of {len(PROMPTS)} answers identical to the leader alone's")
    if mode != "auto":  # (auto may rightly find that no drafter pays on short answers)
        assert kept > 0, mode  # the leader kept drafted tokens: it wrote in fewer passes


def test_members_drafting_asks_the_others_and_lookup_copies_the_given_function(uncached_ensemble):
    members = answer(uncached_ensemble, CODE_EDIT, draft="members")
    assert set(members.stats.drafting) == {"smollm2-135m", "gemma3-270m"}
    assert all(set(r.drafts) <= set(members.stats.drafting) for r in members.rounds)
    lookup = answer(uncached_ensemble, CODE_EDIT, draft="lookup", max_tokens=60)
    tally = lookup.stats.drafting["lookup"]
    # The rewrite repeats the given code: the copies come in several rounds and most of them are kept.
    assert tally["rounds"] >= 2 and tally["kept"] >= tally["proposed"] / 2, tally
    assert lookup.stats.rounds < lookup.stats.tokens / 2


@pytest.fixture(scope="module")
def two_slot_leader():
    """The leader alone, with room for two answers at once (it reads copied drafts: lookup)."""
    with Ensemble(["qwen2.5-coder-0.5b"], slots=2, threads=1, prefix_cache_cells=0) as ensemble:
        yield ensemble


def test_drafting_waits_while_more_answers_are_in_flight_than_draft_users(two_slot_leader):
    prompts = [CODE_EDIT, PROMPTS[1]]

    def requests(**options):
        fusion = FusionOptions.build(temperature=0, max_tokens=40, **options)
        return [FusionRequest.of(p, fusion, top_logprobs=TOP_LOGPROBS) for p in prompts]

    alone = two_slot_leader.generate_many(requests(), max_concurrent=1)  # draft off, one at a time
    together = two_slot_leader.generate_many(requests(draft="lookup"), max_concurrent=2)
    for own, result in zip(alone, together):
        same_until_a_near_tie(result, own)
        # While both were in flight the leader wrote without drafts; the one left alone may draft again.
        assert result.stats.crowded_rounds >= min(r.stats.rounds for r in together) - 1 > 0, result.stats
    allowed = two_slot_leader.generate_many(requests(draft="lookup", draft_users=2), max_concurrent=2)
    assert all(r.stats.crowded_rounds == 0 for r in allowed)
    assert allowed[0].stats.drafting["lookup"]["kept"] > 0  # the code edit copies the given function
    for own, result in zip(alone, allowed):
        same_until_a_near_tie(result, own)


@pytest.mark.parametrize("mode", ["members", "lookup"])
def test_under_a_json_schema_the_leader_keeps_only_what_the_constraint_allows(uncached_ensemble, mode):
    prompt = "Extract the person as JSON: Maria Lopez, 34, lives in Seville."
    asked = {"temperature": 0, "max_tokens": 60, "json_schema": PERSON, "top_logprobs": TOP_LOGPROBS}
    off = uncached_ensemble.generate(prompt, **asked)
    drafted = uncached_ensemble.generate(prompt, **asked, draft=mode)
    assert drafted.valid is True and json.loads(drafted.text)["age"] == 34
    same_until_a_near_tie(drafted, off)


def test_sampling_keeps_the_leaders_own_draws(uncached_ensemble):
    """When sampling, the leader draws each token it keeps itself: seeded answers repeat, and every token
    is one the leader could have drawn (its own log-probability is finite)."""
    first = uncached_ensemble.generate(PROMPTS[1], temperature=0.8, seed=11, max_tokens=30, draft="members")
    again = uncached_ensemble.generate(PROMPTS[1], temperature=0.8, seed=11, max_tokens=30, draft="members")
    assert first.text == again.text


@pytest.fixture(scope="module")
def leader():
    member = load_member("qwen2.5-coder-0.5b", prefix_cache_cells=0)
    yield member
    member.close()


def own_greedy(member, messages, n):
    session = member.start(messages, seed=0, reserve=64)
    try:
        tokens = session.draft(n, Sampling(temperature=0))
        return b"".join(tokens.pieces)
    finally:
        session.close()


@pytest.mark.parametrize(
    "make_draft",
    [
        lambda own: own[: len(own) // 2],  # cut inside a word
        lambda own: " " + own,  # a leading space the answer does not have
        lambda own: own[:5] + "🙂 éà" + own[5:],  # characters a tokenizer spells in byte tokens
        lambda own: own.upper(),  # another spelling altogether
    ],
    ids=["cut-mid-word", "leading-space", "byte-tokens", "other-text"],
)
def test_the_leader_keeps_its_own_tokens_whatever_the_drafts_boundaries(leader, make_draft):
    messages = [Message("user", "Name three fruits, comma separated.")]
    own = own_greedy(leader, messages, 12)
    session = leader.start(messages, seed=0, reserve=64)
    try:
        text = own.decode("utf-8", errors="ignore")
        read = session.speculate([make_draft(text), text[:3]], 12, Sampling(temperature=0))
        kept = b"".join(read.tokens.pieces)
        assert own.startswith(kept) and kept, (own, kept)
        assert len(read.accepted) == 2 and all(a <= p for a, p in zip(read.accepted, read.proposed))
    finally:
        session.close()


def test_a_transformers_leader_reads_drafts_of_another_vocabulary():
    pytest.importorskip("transformers", reason="the hf extra is not installed: pip install '.[hf]'")
    from segfuse import Ensemble

    specs = ["transformers:smollm2-135m#hf-smollm", "gemma3-270m"]
    with Ensemble(specs, prefix_cache_cells=0, threads=1) as ensemble:
        asked = {"temperature": 0, "max_tokens": 24, "leader": "hf-smollm", "top_logprobs": TOP_LOGPROBS}
        for prompt in PROMPTS[:2]:
            off = ensemble.generate(prompt, **asked)
            for mode in ("members", "lookup"):
                drafted = ensemble.generate(prompt, **asked, draft=mode)
                same_until_a_near_tie(drafted, off)
                if mode == "members":  # (lookup drafts only where the answer repeats the prompt)
                    assert any(r.decision == "drafted" for r in drafted.rounds)


@pytest.fixture(scope="module")
def server(uncached_server):
    return uncached_server


def test_the_server_streams_a_drafted_answer_and_reports_its_drafters(openai_client):
    """Through the real server and the `openai` client: the drafted answer streams, and its `segfuse` field
    counts what each drafter proposed and the leader kept."""
    asked = {"model": "segfuse", "messages": [{"role": "user", "content": CODE_EDIT}], "max_tokens": 40}
    stream = openai_client.chat.completions.create(
        **asked, temperature=0, stream=True, extra_body={"segfuse": {"draft": "lookup"}}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = openai_client.chat.completions.create(**asked, temperature=0, extra_body={"segfuse": {"draft": "lookup"}})
    assert text == whole.choices[0].message.content and "def evens" in text
    drafting = whole.model_extra["segfuse"]["stats"]["drafting"]
    assert drafting["lookup"]["kept"] > 0, drafting
    refused = openai_client.with_options(max_retries=0).chat.completions
    with pytest.raises(Exception, match="draft"):
        refused.create(**asked, extra_body={"segfuse": {"draft": "sometimes"}})
