"""Structured output on real members: answers that parse and validate, whoever drafted each segment."""

from __future__ import annotations

import json

import jsonschema
import pytest

from segfuse import Ensemble
from segfuse.backends.registry import load_member
from segfuse.bench.serve.structured import object_schema
from segfuse.models import CATALOGUE, is_ready

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

PERSON = object_schema({"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}})
ORDER = object_schema(
    {
        "items": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "total": {"type": "number"},
        "express": {"type": "boolean"},
    },
    required=["items", "total"],
)
PROMPTS = [
    ("Extract the person as JSON: Maria Lopez, 34, lives in Seville.", PERSON),
    ("Extract the person as JSON: Tom Baker (age 51) moved to Leeds last year.", PERSON),
    ("As JSON: I bought apples, bread and milk for 7.40 euros in total, standard delivery.", ORDER),
]


@pytest.fixture(scope="module")
def ensemble():
    with Ensemble(threads=1) as ens:
        yield ens


def _valid(result, schema) -> dict:
    assert result.stats.finish_reason == "stop", result.text
    assert result.valid is True and result.invalid_reason is None, (result.text, result.invalid_reason)
    value = json.loads(result.text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("prompt, schema", PROMPTS)
def test_the_default_leader_answers_in_the_schema(ensemble, prompt, schema):
    unconstrained = ensemble.generate(prompt, temperature=0, max_tokens=96)
    constrained = ensemble.generate(prompt, temperature=0, max_tokens=96, json_schema=schema)
    assert unconstrained.valid is None  # no constraint, no claim
    _valid(constrained, schema)


@pytest.mark.parametrize("prompt, schema", PROMPTS[:2])
def test_fused_rounds_keep_the_answer_valid(ensemble, prompt, schema):
    """Plain fusion: every member drafts (each under its own tokenizer's mask) and votes."""
    result = ensemble.generate(prompt, temperature=0, max_tokens=96, json_schema=schema, gate=None, accept_margin=None)
    value = _valid(result, schema)
    assert len({c.model for r in result.rounds for c in r.candidates}) == 3  # all three drafted
    assert value["name"]


def test_sampled_answers_stay_valid(ensemble):
    for seed in range(3):
        _valid(
            ensemble.generate(
                PROMPTS[0][0],
                temperature=1.0,
                seed=seed,
                max_tokens=96,
                json_schema=PERSON,
                gate=None,
                accept_margin=None,
            ),
            PERSON,
        )


def test_any_json_object(ensemble):
    result = ensemble.generate(
        "Give me a JSON object describing a cat.", temperature=0, max_tokens=96, json_object=True
    )
    assert isinstance(json.loads(result.text), dict) and result.valid is True


def test_an_answer_cut_short_is_not_claimed_valid(ensemble):
    result = ensemble.generate(PROMPTS[2][0], temperature=0, max_tokens=6, json_schema=ORDER)
    assert result.stats.finish_reason == "length"
    assert result.valid is None
    assert result.text.startswith("{")  # still a valid prefix


def test_a_transformers_member_drafts_under_the_constraint_too():
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    if not is_ready(CATALOGUE["smollm2-135m"]):
        pytest.fail("smollm2-135m is not prepared; run `make models`", pytrace=False)
    hf = load_member("transformers:smollm2-135m", threads=1)
    qwen = load_member("qwen2.5-coder-0.5b", threads=1)
    with Ensemble([hf, qwen]) as ens:
        result = ens.generate(
            PROMPTS[0][0], temperature=0, max_tokens=96, json_schema=PERSON, gate=None, accept_margin=None
        )
        _valid(result, PERSON)
        assert {c.model for r in result.rounds for c in r.candidates} == {hf.name, qwen.name}
