"""Splitting a completion server's text into its tokens' pieces (pure logic, on responses as servers shape them)."""

from __future__ import annotations

from segfuse.backends.remote.logprobs import entries_of, pieces_of


def _pieces(text: str, tokens: list[str], offsets: list[int]) -> list[str]:
    entries = entries_of({"tokens": tokens, "text_offset": offsets, "token_logprobs": [None] * len(tokens)})
    return pieces_of(text, entries)


def test_a_character_goes_to_the_token_that_completes_it():
    # vLLM's echo of "日本の": the first token holds two of 日's three bytes, spelled U+FFFD and counted as a
    # character in the offsets; the second completes it.
    assert _pieces("日本の", ["\ufffd", "", "本", "の"], [0, 1, 1, 2]) == ["", "日", "本", "の"]


def test_a_character_over_three_tokens_moves_along():
    assert _pieces("日本", ["\ufffd", "\ufffd", ""], [0, 1, 2]) == ["", "日", "本"]


def test_a_replacement_character_in_the_text_stays():
    assert _pieces("a\ufffdb", ["a", "\ufffd", "b"], [0, 1, 2]) == ["a", "\ufffd", "b"]


def test_empty_pieces_for_half_characters_are_kept():
    # llama-cpp-python and vLLM's drafts: tokens that end inside a character are empty, the last one spells it.
    assert _pieces(" 🎉!", ["", "", " 🎉", "!"], [0, 0, 0, 2]) == ["", "", " 🎉", "!"]


def test_special_tokens_a_server_skips_in_generated_text_are_empty():
    # vLLM's answer after "Write a haiku about the sea." run past its end: the special tokens are listed, left
    # out of the text (skip_special_tokens), and still counted by the offsets.
    tokens = [" found", ".", "<|im_end|>", "\n", "<|im_end|>", "<|im_start|>", "system", "\n", "I"]
    offsets = [178, 184, 185, 195, 196, 206, 218, 224, 225]
    text = " found.\nsystem\nI"
    entries = entries_of({"tokens": tokens, "text_offset": offsets, "token_logprobs": [None] * len(tokens)})
    assert pieces_of(text, entries, generated=True) == [" found", ".", "", "\n", "", "", "system", "\n", "I"]


def test_an_end_token_listed_after_the_text_is_empty():
    entries = entries_of(
        {"tokens": ["Paris", ".", "<|im_end|>"], "text_offset": [0, 5, 6], "token_logprobs": [None] * 3}
    )
    assert pieces_of("Paris.", entries) == ["Paris", ".", ""]
