"""answer_logprobs: the answer's tokens as their authors drafted them, joined exactly to the answer."""

from __future__ import annotations

from segfuse.logprobs import answer_logprobs
from segfuse.types import Segment, TokenTrail


def segment(text: str, pieces: list[bytes], logprobs: list[float], model: str = "a", tops=()) -> Segment:
    return Segment(text, model, 1, TokenTrail(tuple(pieces), tuple(logprobs), tuple(tops)))


def test_tokens_of_several_authors_join_to_the_answer():
    segments = [
        segment("Hello", [b"Hel", b"lo"], [-0.5, -0.25], "a", [((b"Hel", -0.5), (b"Hi", -1.0)), ((b"lo", -0.25),)]),
        segment(" world", [b" world"], [-1.0], "b"),
    ]
    tokens = answer_logprobs(segments)
    assert [t.text for t in tokens] == ["Hel", "lo", " world"]
    assert [t.model for t in tokens] == ["a", "a", "b"]
    assert tokens[0].top == (("Hel", b"Hel", -0.5), ("Hi", b"Hi", -1.0)) and tokens[2].top == ()


def test_a_character_split_across_tokens_is_one_entry():
    e_acute = "é".encode()
    tokens = answer_logprobs([segment("café", [b"caf", e_acute[:1], e_acute[1:]], [-1.0, -0.5, -0.25])])
    assert [t.text for t in tokens] == ["caf", "é"] and tokens[1].logprob == -0.75
    assert tokens[1].bytes == e_acute


def test_a_token_cut_by_a_stop_string_is_shortened():
    # the stop string "\n" cut the draft inside its last token: the entry keeps only the answer's part
    tokens = answer_logprobs([segment("Yes.", [b"Yes", b".\n"], [-0.1, -0.2])])
    assert "".join(t.text for t in tokens) == "Yes." and tokens[-1].text == "."
