"""Cutting drafts at word, character and stop-string boundaries (pure logic)."""

from segfuse.segments import apply_stops, complete_utf8_prefix, cut_draft, find_stop


def test_mid_word_draft_is_cut_before_the_last_word():
    cut = cut_draft([b" The", b" quick", b" bro"], finished=False)
    assert cut.text == " The quick"
    assert cut.n_tokens == 2


def test_draft_ending_in_punctuation_is_kept_whole():
    cut = cut_draft([b" Red", b",", b" blue", b"."], finished=False)
    assert cut == cut_draft([b" Red", b",", b" blue", b"."], finished=False)
    assert cut.text == " Red, blue."
    assert cut.n_tokens == 4


def test_single_word_is_kept_rather_than_leaving_nothing():
    cut = cut_draft([b" Photos", b"ynth"], finished=False)
    assert cut.text == " Photosynth"
    assert cut.n_tokens == 2


def test_word_split_over_tokens_drops_the_whole_partial_word():
    cut = cut_draft([b" is", b" photos", b"ynth"], finished=False)
    assert cut.text == " is"
    assert cut.n_tokens == 1


def test_trailing_spaces_go_to_the_next_segment():
    cut = cut_draft([b" Hi", b".", b" "], finished=False)
    assert cut.text == " Hi."
    assert cut.n_tokens == 2


def test_newline_at_the_end_is_kept():
    cut = cut_draft([b" Hi", b".", b"\n"], finished=False)
    assert cut.text == " Hi.\n"


def test_finished_draft_is_kept_whole_even_mid_word():
    cut = cut_draft([b" abc", b"def", b""], finished=True)
    assert cut.text == " abcdef"
    assert cut.n_tokens == 3


def test_split_multibyte_character_never_leaks():
    snowman = "☃".encode()  # 3 bytes
    cut = cut_draft([b" snow", b" ", snowman[:2]], finished=False)
    assert "\ufffd" not in cut.text
    assert cut.text == " snow"
    whole = cut_draft([b" snow", b" ", snowman[:2], snowman[2:], b"!"], finished=False)
    assert whole.text == " snow ☃!"


def test_complete_utf8_prefix():
    data = "aé☃".encode()
    assert complete_utf8_prefix(data) == len(data)
    assert complete_utf8_prefix(data[:-1]) == len("aé".encode())
    assert complete_utf8_prefix(data[:2]) == 1
    assert complete_utf8_prefix(b"") == 0


def test_find_stop_earliest():
    assert find_stop("abc STOP def END", ["END", "STOP"]) == 4
    assert find_stop("abc", ["x"]) == -1


def test_stop_string_inside_candidate_truncates_it():
    assert apply_stops("The answer", " is 4.\nQuestion: next", ["\nQuestion:"]) == (" is 4.", True)


def test_stop_string_spanning_segments_is_found():
    # "###" starts in the accepted answer and ends in the candidate.
    assert apply_stops("result ##", "# more", ["###"]) == ("", True)


def test_no_stop_keeps_candidate():
    assert apply_stops("a", " b c", ["zzz"]) == (" b c", False)
    assert apply_stops("a", " b c", []) == (" b c", False)
