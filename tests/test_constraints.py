"""Constraints (structured output) as pure logic: schemas checked up front, candidates judged by bytes."""

from __future__ import annotations

import pytest

from segfuse.constraints import Constraint, TextMatcher
from segfuse.errors import InvalidRequestError

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_a_candidate_may_extend_the_answer_only_within_the_schema():
    matcher = TextMatcher(Constraint.json_schema(PERSON))
    assert matcher.allows("", '{"name": "Al')
    assert matcher.allows('{"name": "Al', 'ice", "age": 3')  # any split of the text, whoever wrote which part
    assert not matcher.allows("", "Sure! {")  # prose before the object
    assert not matcher.allows('{"name": "Alice", ', '"city"')  # a key the schema does not have
    assert not matcher.allows('{"name": "Alice", "age": ', '"three"')  # a string where an integer goes
    assert not matcher.complete('{"name": "Alice"')
    assert matcher.complete('{"name": "Alice", "age": 3}')
    assert matcher.finished('{"name": "Alice", "age": 3}')  # nothing may follow the closing brace
    assert matcher.allows('{"name": "Bob"', ', "age": 41}')  # the matcher goes back when the answer differs


def test_any_json_object():
    matcher = TextMatcher(Constraint.json_object())
    assert matcher.allows("", '{"anything": [1, 2, {"x": null}]}')
    assert not matcher.allows("", "[1, 2]")
    assert matcher.complete('{"a": true}')


def test_finished_answers_are_checked_against_the_schema():
    constraint = Constraint.json_schema(PERSON)
    assert constraint.check('{"name": "Alice", "age": 3}') is None
    assert "required" in constraint.check('{"name": "Alice"}')
    assert "not JSON" in constraint.check('{"name": "Al')
    assert "does not validate" in Constraint.json_object().check("[1]")  # an array is not an object


def test_a_grammar_constrains_too():
    constraint = Constraint.lark('start: "yes" | "no"')
    matcher = TextMatcher(constraint)
    assert matcher.allows("", "ye") and not matcher.allows("", "maybe")
    assert constraint.check("no") is None and constraint.check("nope") is not None


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "objectx"}, "not a valid JSON schema"),
        ({"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}}, "not a valid JSON schema"),
        ("not a schema", "must be a JSON object"),
    ],
)
def test_a_bad_schema_is_the_callers_error(schema, words):
    with pytest.raises(InvalidRequestError) as caught:
        Constraint.json_schema(schema)
    assert words in caught.value.message


def test_a_bad_grammar_is_the_callers_error():
    with pytest.raises(InvalidRequestError):
        Constraint.lark("start: (")
