"""Drafting for the leader, its pure logic: the walk down the drafts (what the leader keeps), the
lookup's copied text, and the planner that decides who drafts (docs/performance.md#drafting)."""

from __future__ import annotations

import math

import pytest

from segfuse.backends.drafting import DraftProgress
from segfuse.backends.speculation import distinct_drafts, walk
from segfuse.engine.drafted import draft_text
from segfuse.engine.drafting import LOOKUP, DraftPlanner, expected_tokens, lookup_draft
from segfuse.options import FusionOptions
from segfuse.types import DraftTokens, Sampling

END = 99  # the walk's end-of-answer token in these tests


def greedy_walk(drafts, own, limit=16):
    """Walk `drafts` where the member would write `own` (its own greedy tokens from the context on);
    a row is the member's own tokens so far, and picking reads the next of them."""
    rows = {}

    def row_at(d, p):
        rows.setdefault(d, []).append(p)
        return p  # the row after p tokens: the position itself

    return walk(drafts, row_at, lambda row, kept: own[row], lambda t: t == END, limit), rows


def test_the_walk_keeps_the_longest_agreeing_draft_then_its_own_token():
    own = [1, 2, 3, 4, 5, 6]
    walked, _ = greedy_walk([[1, 2, 9], [1, 2, 3, 4, 7], [8]], own)
    assert walked.kept == [1, 2, 3, 4, 5]  # four read from the second draft, then its own fifth
    assert walked.accepted == [2, 4, 0]
    assert walked.source == 1


def test_the_walk_keeps_one_token_of_its_own_when_every_draft_differs_or_none_is_given():
    walked, _ = greedy_walk([[7, 7], [8]], [1, 2, 3])
    assert walked.kept == [1] and walked.accepted == [0, 0]
    walked, _ = greedy_walk([], [1, 2, 3])
    assert walked.kept == [1]


def test_a_draft_read_whole_gives_the_token_after_it_and_the_limit_bounds_the_kept_tokens():
    own = [1, 2, 3, 4]
    walked, rows = greedy_walk([[1, 2]], own)
    assert walked.kept == [1, 2, 3] and walked.accepted == [2]
    assert rows[0] == [0, 1, 2]  # the row after the whole draft gave the own token
    walked, _ = greedy_walk([[1, 2, 3, 4]], [*own, 5], limit=3)
    assert walked.kept == [1, 2, 3]


def test_the_walk_stops_at_the_end_token():
    walked, _ = greedy_walk([[1, END, 5]], [1, END, 5, 6])
    assert walked.kept == [1, END]


def test_sampling_draws_once_per_kept_token():
    """A sampling member draws once per token it keeps, in order, as it draws writing alone."""
    draws = iter([1, 2, 3, 4])
    picked = []

    def pick(row, kept):
        picked.append(row)
        return next(draws)

    walked = walk([[1, 2, 8]], lambda d, p: p, pick, lambda t: False, 10)
    assert walked.kept == [1, 2, 3] and picked == [0, 1, 2]


def test_distinct_drafts_are_cut_to_the_limit_and_dedupe():
    distinct, where = distinct_drafts([[1, 2, 3], [1, 2], [], [1, 2, 3, 4]], 2)
    assert distinct == [[1, 2]] and where == [0, 0, -1, 0]


def test_lookup_copies_what_followed_the_answers_last_words():
    source = "def add(a, b):\n    return a + b\n\nPlease rewrite it with type hints."
    assert lookup_draft(source, "def add(a: int, b: int) -> int:\n    return a", 12) == " + b\n\nPlease"
    assert lookup_draft(source, "Zebras", 12) == ""
    assert lookup_draft(source, "", 12) == ""


def test_lookup_prefers_the_longest_match_and_the_latest_place():
    answer = "one two three. one two four. one two"
    assert lookup_draft("", answer, 6) == " four."


def options(**kw):
    return FusionOptions.build(temperature=0.0, **kw)


def test_members_and_lookup_modes_ask_their_drafters_every_round():
    planner = DraftPlanner(options(draft="members"), ["small", "tiny"])
    # A model drafts up to draft_max: its draft ends by itself where it grows unsure.
    first = planner.plan(1, lookup_ready=True, members={"small": 0.3, "tiny": None})
    assert first.lengths == {"small": 16, "tiny": 16}
    planner = DraftPlanner(options(draft="lookup"), ["small"])
    assert planner.plan(1, lookup_ready=True, members={"small": 0.3}).lengths == {LOOKUP: 6}
    assert not planner.plan(1, lookup_ready=False, members={"small": 0.3}).drafting


def test_the_draft_length_grows_after_a_draft_kept_whole_and_shrinks_after_a_miss():
    planner = DraftPlanner(options(draft="members", draft_max=6), ["small"])
    planner.learned_draft("small", 4, 4, 0.01)
    assert planner.drafters["small"].length == 6
    planner.learned_draft("small", 6, 6, 0.01)
    assert planner.drafters["small"].length == 6  # at most draft_max
    planner.learned_draft("small", 1, 6, 0.01)
    assert planner.drafters["small"].length == 5


def test_auto_writes_alone_first_then_tries_the_drafters_expected_to_pay_then_benches_one_that_does_not():
    planner = DraftPlanner(options(draft="auto"), ["small"])
    small = {"small": 0.08}  # a tenth of the leader's size or so: expected to draft a token in 8 % of its time
    assert not planner.plan(1, lookup_ready=True, members=small).drafting  # first the leader alone
    planner.learned_alone(0.3, 10)  # 30 ms a token
    # Reading as a 2-core CPU does (half a token per token read), only the free copy may pay.
    assert set(planner.plan(2, lookup_ready=True, members=small).lengths) == {LOOKUP}
    for _ in range(4):  # passes that read 10 tokens for little more than one (as on a GPU)
        planner.learned_read(0.03 * 1.2, 10)
    assert set(planner.plan(3, lookup_ready=True, members=small).lengths) == {LOOKUP, "small"}
    for _ in range(3):  # a drafter the leader never agrees with, and a lookup that copies nothing useful
        planner.learned_draft("small", 0, 4, 4 * 0.0025)
        planner.learned_draft(LOOKUP, 0, 8, None)
    # The drafter does not pay: benched. (A one-token copy still may, where reading is nearly free.)
    assert "small" not in planner.plan(5, lookup_ready=True, members=small).lengths
    assert planner.drafters["small"].benched_until > 5
    for _ in range(6):  # reading as a 2-core CPU does again: nothing pays, the leader writes alone
        planner.learned_read(0.03 * 5.5, 10)
    assert not planner.plan(6, lookup_ready=True, members=small).drafting
    assert planner.drafters[LOOKUP].benched_until > 6
    assert not planner.plan(10, lookup_ready=True, members=small).drafting  # still benched


def test_auto_does_not_try_a_drafter_whose_size_alone_says_it_cannot_pay():
    """A third of the leader's size: drafting a token costs a third of writing one, reading it more; at the
    acceptance a drafter starts with, no draft length pays."""
    planner = DraftPlanner(options(draft="auto"), ["third"])
    planner.learned_alone(0.3, 10)
    assert not planner.plan(2, lookup_ready=False, members={"third": 0.33}).drafting
    planner.learned_read(0.03 * 1.1, 10)  # where reading costs hardly more than writing one (a GPU), it does
    for _ in range(5):
        planner.learned_read(0.03 * 1.1, 10)
    assert planner.plan(3, lookup_ready=False, members={"third": 0.33}).drafting


def test_auto_keeps_a_drafter_that_pays_and_only_the_best_of_the_models():
    planner = DraftPlanner(options(draft="auto"), ["fast", "slow"])
    planner.learned_alone(0.3, 10)
    for _ in range(4):
        planner.learned_draft("fast", 6, 6, 6 * 0.003)  # cheap and always right
        planner.learned_draft("slow", 6, 6, 6 * 0.02)  # right, but drafting costs two thirds of the leader
        planner.learned_draft(LOOKUP, 7, 8, None)
    plan = planner.plan(6, lookup_ready=True, members={"fast": 0.1, "slow": 0.6})
    assert set(plan.lengths) == {LOOKUP, "fast"}
    assert plan.lengths["fast"] > 4  # a long draft pays when the leader keeps nearly all of it


@pytest.mark.parametrize(("acceptance", "length", "expected"), [(0.0, 4, 1.0), (0.5, 1, 1.5), (0.999, 3, 4.0)])
def test_expected_tokens_per_round(acceptance, length, expected):
    assert expected_tokens(acceptance, length) == pytest.approx(expected, rel=0.01)


def test_draft_modes_are_validated():
    with pytest.raises(Exception, match="draft"):
        FusionOptions.build(draft="sometimes")


def test_drafts_need_a_leader_that_reads_them_in_one_pass():
    """Members that cannot speculate (a remote server's, here scripted) are refused up front, naming the field."""
    from fakes import ScriptedMember
    from segfuse.engine import fuse
    from segfuse.errors import InvalidRequestError
    from segfuse.request import FusionRequest
    from segfuse.types import Message

    members = [ScriptedMember("remote-a", []), ScriptedMember("remote-b", [])]
    request = FusionRequest.of([Message("user", "hi")], options(draft="lookup"))
    with pytest.raises(InvalidRequestError, match="reads drafts in one pass") as refused:
        list(fuse(members, request))
    assert refused.value.field == "draft"


def test_a_drafters_tokens_become_text_up_to_bytes_that_are_not_utf8():
    def tokens(*pieces: bytes) -> DraftTokens:
        n = len(pieces)
        return DraftTokens(pieces, (0.0,) * n, (0.0,) * n, False, ())

    assert draft_text(tokens(b" caf", b"\xc3\xa9", b" ok")) == " café ok"
    assert draft_text(tokens(b" caf", b"\xc3")) == " caf"  # a character not finished yet waits
    assert draft_text(tokens(b" x", b"\xa2", b" y")) == " x"  # a lone continuation byte ends the draft
    assert draft_text(tokens(b"\xa2\xa2")) == ""


def test_a_draft_ends_after_a_token_its_drafter_is_unsure_of():
    sure, unsure = math.log(0.9), math.log(0.3)
    draft = DraftProgress(10, Sampling(temperature=0.0, stop_below=0.4), None, start=0)
    assert draft.took(None, 1, sure, 0.0, False)
    assert not draft.took(None, 2, unsure, 0.0, False)  # kept, and the last
    assert draft.ids == [1, 2] and draft.done and not draft.finished
    anyway = DraftProgress(10, Sampling(temperature=0.0), None, start=0)  # 0: drafts run to their length
    assert anyway.took(None, 1, unsure, 0.0, False)
