"""The engine loop on scripted members: pure logic of rank/broadcast/stop.

These fakes only check the loop's bookkeeping; the real-model behaviour is in
test_real_models.py.
"""

from __future__ import annotations

import pytest

from fakes import FittedSession, ScriptedMember, ScriptedSession, fitted
from helpers import PLAIN_FUSION
from segfuse.engine import fuse
from segfuse.errors import InvalidRequestError
from segfuse.options import FusionOptions
from segfuse.request import FusionRequest
from segfuse.types import DoneEvent, RoundEvent, SegmentEvent


def run(members, **options):
    # Plain fusion unless a test asks for Model Exit or Hedge: these tests check the round mechanics.
    events = list(fuse(members, FusionRequest.of("q", FusionOptions.build(**{**PLAIN_FUSION, **options}))))
    assert isinstance(events[-1], DoneEvent)
    return events, events[-1].result


def test_majority_preference_wins_and_everyone_gets_the_winner():
    a = ScriptedSession([([b" Red", b"."], False), ([b""], True)], {" Red.": 0.9, " Blue.": 0.2})
    b = ScriptedSession([([b" Blue", b"."], False), ([b""], True)], {" Red.": 0.8, " Blue.": 0.3})
    c = ScriptedSession([([b" Blue", b"."], False), ([b""], True)], {" Red.": 0.1, " Blue.": 0.9})
    events, result = run([ScriptedMember("a", a), ScriptedMember("b", b), ScriptedMember("c", c)])
    assert result.text == " Red."
    assert [s.model for s in result.segments] == ["a"]
    assert a.accepted == b.accepted == c.accepted == [" Red.", ""]
    assert result.stats.finish_reason == "stop"
    assert all(s.closed for s in (a, b, c))
    first = next(e for e in events if isinstance(e, RoundEvent)).record
    assert set(first.scores) == {"a", "b", "c"}
    assert all(len(row) == 3 for row in first.scores.values())
    assert all(sum(row) == pytest.approx(1.0) for row in first.scores.values())
    # segment events come before the round record and concatenate to the text
    assert "".join(e.segment.text for e in events if isinstance(e, SegmentEvent)) == result.text


def test_ties_pick_the_lowest_member_index():
    a = ScriptedSession([([b" x", b".", b""], True)], {})
    b = ScriptedSession([([b" y", b".", b""], True)], {})
    _, result = run([ScriptedMember("a", a), ScriptedMember("b", b)])
    assert result.segments[0].model == "a"


def test_max_tokens_limits_the_answer():
    drafts = [([b" w", b" w", b"."], False)] * 10
    a = ScriptedSession(drafts, {})
    _, result = run([ScriptedMember("a", a)], max_tokens=7, window=3)
    assert result.stats.tokens == 7
    assert result.stats.finish_reason == "length"


def test_stop_string_ends_the_answer_before_it():
    a = ScriptedSession([([b" 4", b".", b"\n", b"Question", b":"], False)], {})
    _, result = run([ScriptedMember("a", a)], stop=["\nQuestion:"])
    assert result.text == " 4."
    assert result.stats.finish_reason == "stop"


def test_member_stop_strings_apply_to_that_members_drafts():
    a = ScriptedSession([([b" 4", b".", b"\n", b"Question", b":"], False)], {}, stops=("\nQuestion:",))
    _, result = run([ScriptedMember("a", a)])
    assert result.text == " 4."


def test_self_scores_can_be_excluded():
    # finished drafts end with the end-of-generation token's empty piece
    a = ScriptedSession([([b" A", b".", b""], True)], {" A.": 1.0, " B.": 0.01, " C.": 0.01})
    b = ScriptedSession([([b" B", b".", b""], True)], {" A.": 0.01, " B.": 1.0, " C.": 0.01})
    c = ScriptedSession([([b" C", b".", b""], True)], {" A.": 0.9, " B.": 0.1, " C.": 0.1})
    _, result = run([ScriptedMember(n, s) for n, s in zip("abc", (a, b, c))], self_score=False)
    record = result.rounds[0]
    assert record.raw_scores["a"][0] is None and record.scores["a"][0] == 0.0
    assert result.text == " A."


def test_bad_options_are_clear_errors():
    with pytest.raises(InvalidRequestError, match="window"):
        FusionOptions.build(window=0)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        FusionOptions.build(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="score"):
        FusionOptions.build(score="best")


class BrokenSession(ScriptedSession):
    """Fails on its n-th draft, like a member whose server died mid-answer."""

    def __init__(self, drafts, prefs, fail_at):
        super().__init__(drafts, prefs)
        self.fail_at = fail_at
        self.calls = 0

    def draft(self, max_tokens, sampling):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("server went away")
        return super().draft(max_tokens, sampling)


def test_a_member_that_fails_mid_answer_is_dropped_and_the_answer_completes():
    words = [([b" one", b"."], False), ([b" two", b"."], False), ([b""], True)]
    a = ScriptedSession(list(words), {" one.": 0.9, " two.": 0.9})
    broken = BrokenSession(list(words), {}, fail_at=2)
    _, result = run([ScriptedMember("a", a), ScriptedMember("b", broken)])
    assert result.text == " one. two."
    assert [(d.model, d.round, d.kind) for d in result.departures] == [("b", 2, "fault")]
    assert "server went away" in result.departures[0].reason
    assert broken.closed
    assert result.rounds[1].active == ["a"]
    assert result.rounds[1].departures[0].model == "b"


def test_no_member_left_is_a_clear_error():
    from segfuse.errors import MemberFailedError

    broken = BrokenSession([], {}, fail_at=1)
    with pytest.raises(MemberFailedError, match="no member"):
        run([ScriptedMember("b", broken)])
    assert broken.closed


def test_hedge_weights_are_recorded_and_favour_the_consensus_member():
    # a and c prefer a's drafts, b prefers its own: a gains weight.
    drafts = [([b" x", b"."], False)] * 3 + [([b""], True)]
    prefs_a = {" x.": 0.9}
    a = ScriptedSession(list(drafts), prefs_a)
    b = ScriptedSession([([b" y", b"."], False)] * 3 + [([b""], True)], {" y.": 0.9, " x.": 0.1})
    c = ScriptedSession([([b" z", b"."], False)] * 3 + [([b""], True)], {" x.": 0.9})
    _, result = run([ScriptedMember(n, s) for n, s in zip("abc", (a, b, c))], hedge=True)
    first = result.rounds[0].weights
    assert first["a"] > first["c"] and first["a"] > 1 / 3
    assert sum(first.values()) == pytest.approx(1.0)
    assert result.weights["a"] == max(result.weights.values())


def test_model_exit_removes_a_lagging_member_but_never_the_last():
    drafts = [([b" w", b"."], False)] * 8 + [([b""], True)]
    good = {" w.": 0.9, " v.": 0.05, " u.": 0.05}
    sessions = [
        ScriptedSession(list(drafts), good),
        ScriptedSession([([b" v", b"."], False)] * 8 + [([b""], True)], good),
        ScriptedSession([([b" u", b"."], False)] * 8 + [([b""], True)], good),
    ]
    _, result = run(
        [ScriptedMember(n, s) for n, s in zip("abc", sessions)],
        exit=True,
        exit_warmup=2,
        exit_entropy=0.99,
        exit_min_active=1,
    )
    exits = [d for d in result.departures if d.kind == "exit"]
    assert {d.model for d in exits} == {"b", "c"}
    assert all(d.round >= 2 for d in exits)
    assert result.rounds[-1].active == ["a"]
    assert result.stats.finish_reason == "stop"
    assert result.stats.model_calls < 2 * 3 * result.stats.rounds


# --- selection: gate, leader, guard, prompt-fit prior ---------------------------------


def test_a_confident_leader_wins_alone_and_the_others_only_follow():
    strong = FittedSession([([b" Four", b"."], False), ([b""], True)], {" Four.": 0.9, "": 0.9}, bpb=0.8)
    weak = FittedSession([([b" Five", b"."], False), ([b""], True)], {" Five.": 0.99}, bpb=1.4)
    events, result = run([fitted("weak", weak), fitted("strong", strong)], gate=0.5, prior="prompt")
    assert result.text == " Four."
    records = [e.record for e in events if isinstance(e, RoundEvent)]
    assert all(r.gated and r.leader == "strong" for r in records)
    assert weak.drafted == 0 and weak.accepted == strong.accepted == [" Four.", ""]
    assert result.stats.gated_rounds == 2 and result.stats.model_calls == 2 + 2  # 2 prompt fits + 2 drafts
    assert result.prompt_bpb == {"weak": pytest.approx(1.4), "strong": pytest.approx(0.8)}
    assert result.weights["strong"] > 0.99


def test_an_unsure_leader_calls_a_full_round():
    strong = FittedSession([([b" Four", b"."], False), ([b""], True)], {" Four.": 0.3, " Five.": 0.1}, bpb=0.8)
    weak = FittedSession([([b" Five", b"."], False), ([b""], True)], {" Five.": 0.2, " Four.": 0.6}, bpb=1.4)
    events, result = run([fitted("weak", weak), fitted("strong", strong)], gate=0.5, prior="prompt", leader="strong")
    first = next(e for e in events if isinstance(e, RoundEvent)).record
    assert not first.gated and first.leader == "strong"
    assert first.confidence == pytest.approx(0.3)
    assert [c.model for c in first.candidates] == ["weak", "strong"]  # member order, not draft order
    assert weak.drafted >= 1 and result.text.startswith(" Four.")


def test_gate_above_one_never_skips_a_round():
    a = FittedSession([([b" Four", b"."], False), ([b""], True)], {" Four.": 1.0, "": 1.0}, bpb=0.8)
    b = FittedSession([([b" Four", b"."], False), ([b""], True)], {" Four.": 1.0, "": 1.0}, bpb=0.9)
    _, result = run([fitted("a", a), fitted("b", b)], gate=1.01)
    assert result.stats.gated_rounds == 0 and b.drafted == 2


def test_unknown_leader_is_a_clear_error():
    a = ScriptedSession([([b" x"], True)], {})
    with pytest.raises(InvalidRequestError, match="leader"):
        run([ScriptedMember("a", a)], gate=0.5, leader="nobody")


def test_the_guard_keeps_a_loop_from_winning():
    loop, fresh = " one two three four.", " and then five."

    def pair():
        a = ScriptedSession([([loop.encode()], False)] * 2 + [([b""], True)], {loop: 0.95, fresh: 0.2, "": 0.9})
        b = ScriptedSession(
            [([loop.encode()], False), ([fresh.encode()], False), ([b""], True)], {loop: 0.9, fresh: 0.3, "": 0.9}
        )
        return [ScriptedMember("a", a), ScriptedMember("b", b)]

    _, unguarded = run(pair())
    assert unguarded.text == loop + loop  # mean probability alone prefers the loop
    events, guarded = run(pair(), guard=True)
    second = [e for e in events if isinstance(e, RoundEvent)][1].record
    assert second.penalised == {"a": "repeats the last segment"}
    assert guarded.text == loop + fresh


def test_the_guard_gives_up_when_every_candidate_loops():
    """Votes cost time; after `guard_patience` votes where all loop, the confident leader goes alone again."""
    lap = " one two three four."

    def looping_pair():
        strong = FittedSession([([lap.encode()], False)] * 9 + [([b""], True)], {lap: 0.9, "": 0.9}, bpb=0.8)
        weak = FittedSession([([lap.encode()], False)] * 9 + [([b""], True)], {lap: 0.9, "": 0.9}, bpb=1.4)
        return strong, weak, [fitted("strong", strong), fitted("weak", weak)]

    _strong, weak, members = looping_pair()
    events, _result = run(members, gate=0.5, guard=True, guard_patience=2, prior="prompt", max_tokens=9)
    records = [e.record for e in events if isinstance(e, RoundEvent)]
    # round 1 is gated (nothing to repeat yet); rounds 2 and 3 vote and find everyone looping; then alone again
    assert [r.gated for r in records][:5] == [True, False, False, True, True]
    assert all(len(r.penalised) == 2 for r in records[1:3])
    assert weak.drafted == 2


# --- the leader verifies ----------------------------------------------------------------------


def consulting_round(**options):
    """An unsure leader (mean probability 0.3 < gate 0.5) and two others who both prefer a third text."""
    leader = ScriptedSession([([b" Four", b"."], False), ([b""], True)], {" Four.": 0.3, " Five.": 0.05, "": 0.9})
    weak1 = ScriptedSession([([b" Five", b"."], False), ([b""], True)], {" Five.": 0.9, " Four.": 0.05, "": 0.9})
    weak2 = ScriptedSession([([b" Five", b"."], False), ([b""], True)], {" Five.": 0.9, " Four.": 0.05, "": 0.9})
    members = [
        ScriptedMember("weak1", weak1, n_params=1),
        ScriptedMember("lead", leader, n_params=9),
        ScriptedMember("weak2", weak2, n_params=1),
    ]
    _events, result = run(members, gate=0.5, **options)
    return result, (leader, weak1, weak2)


def test_a_proposal_the_leader_rejects_cannot_win_however_the_others_vote():
    today, _ = consulting_round()
    assert today.text.startswith(" Five.")  # without the leader's test, the two weak members outvote it
    verified, (leader, weak1, weak2) = consulting_round(accept_margin=1.0)
    first = verified.rounds[0]
    assert verified.text.startswith(" Four.") and first.winner == "lead" and not first.gated
    assert first.decision == "rejected"
    assert set(first.consulted) == {"weak1", "weak2"} and all(
        v.startswith("rejected") for v in first.consulted.values()
    )
    assert leader.scored[0] == [" Five."]  # the leader scored the proposal once, in one call
    assert weak1.scored == weak2.scored == []  # nothing was accepted: the others verified nothing


def test_an_accepted_proposal_goes_to_the_vote():
    result, (_leader, weak1, weak2) = consulting_round(accept_margin=4.0)  # " Five." is 2.9 nats below its top choice
    first = result.rounds[0]
    assert all(v.startswith("accepted") for v in first.consulted.values())
    assert result.text.startswith(" Five.") and first.winner == "weak1" and first.decision == "vote"
    assert weak1.scored and weak2.scored  # the others verified what was accepted


def test_margin_zero_is_the_leader_alone_and_none_is_todays_vote():
    alone, (_leader, weak1, weak2) = consulting_round(accept_margin=0.0)
    assert alone.text == " Four." and weak1.drafted == weak2.drafted == 0
    assert all(r.gated and r.winner == "lead" for r in alone.rounds)
    assert alone.rounds[0].decision == "alone"  # unsure (0.3 < gate 0.5), yet nobody is consulted
    vote, _ = consulting_round(accept_margin=None)
    plain, _ = consulting_round()
    assert vote.text == plain.text and [r.winner for r in vote.rounds] == [r.winner for r in plain.rounds]


# --- members the options never consult ---------------------------------------------------------


def test_the_leader_alone_starts_only_the_leader():
    result, (leader, weak1, weak2) = consulting_round(accept_margin=0.0)
    assert result.text == " Four."
    assert leader.accepted == [" Four.", ""]
    assert weak1.accepted == weak2.accepted == []  # on standby: they never read the prompt or the answer
    assert set(result.counters) == {"lead"}


def test_the_leader_alone_keeps_its_whole_draft_and_a_vote_cuts_it_at_a_words_start():
    """No other member reads the leader's segment when it answers alone, so a draft that ends inside a word is
    kept whole (its tokens past the word's start are not decoded again next round); a vote cuts it."""

    def scripted():
        return ScriptedSession([([b" Four", b" fi"], False), ([b"ve", b"."], False), ([b""], True)], {})

    lead, weak = scripted(), ScriptedSession([], {})
    alone = [ScriptedMember("weak", weak, n_params=1), ScriptedMember("lead", lead, n_params=9)]
    _, result = run(alone, gate=0.5, accept_margin=0.0)
    assert lead.accepted[:2] == [" Four fi", "ve."] and result.text == " Four five."
    voter = scripted()
    run([ScriptedMember("voter", voter), ScriptedMember("other", ScriptedSession([], {}))])
    assert voter.accepted[0] == " Four"  # cut back to the last word's start


def test_eager_followers_read_and_follow_everything():
    result, (leader, weak1, weak2) = consulting_round(accept_margin=0.0, followers="eager")
    assert result.text == " Four."
    assert weak1.accepted == weak2.accepted == leader.accepted == [" Four.", ""]
    assert weak1.drafted == weak2.drafted == 0


def test_a_standby_member_catches_up_once_and_finishes_when_the_leader_fails():
    words = [([b" one", b"."], False), ([b" two", b"."], False), ([b""], True)]
    leader = BrokenSession(list(words), {" one.": 0.9}, fail_at=2)
    big = ScriptedSession(list(words[1:]), {" two.": 0.9, "": 0.9})
    small = ScriptedSession(list(words), {})
    members = [
        ScriptedMember("small", small, n_params=1),
        ScriptedMember("lead", leader, n_params=9),
        ScriptedMember("big", big, n_params=5),
    ]
    _events, result = run(members, gate=0.5, accept_margin=0.0)
    assert result.text == " one. two."
    assert big.accepted == [" one.", " two.", ""]  # the answer so far at once, then each segment
    assert small.accepted == [] and members[0].started == 0  # never needed
    assert [(d.model, d.round, d.kind) for d in result.departures] == [("lead", 2, "fault")]
    assert [r.leader for r in result.rounds] == ["lead", "big", "big"]
    assert leader.closed


def test_a_leader_that_cannot_start_hands_over_before_round_one():
    class Refusing(ScriptedMember):
        def start(self, messages, *, seed, reserve):
            raise ConnectionError("refused")

    other = ScriptedSession([([b" Yes", b"."], False), ([b""], True)], {" Yes.": 0.9, "": 0.9})
    members = [Refusing("lead", n_params=9), ScriptedMember("other", other, n_params=1)]
    _, result = run(members, gate=0.5, accept_margin=0.0)
    assert result.text == " Yes."
    assert [(d.model, d.round) for d in result.departures] == [("lead", 0)]


# --- structured output: the engine's side of a constraint ---------------------------------------


class ConstrainedSession(ScriptedSession):
    """A scripted session that says it drafts under a constraint (the drafts are what the test scripts)."""

    def constrain(self, constraint):
        self.constraint = constraint


def test_under_a_constraint_a_candidate_that_breaks_it_cannot_win():
    from segfuse.backends.base import Capabilities
    from segfuse.constraints import Constraint

    # b's prose is preferred by every verifier, but it is not JSON: a's object wins.
    a = ConstrainedSession([([b'{"ok"', b": true}"], True)], {'{"ok": true}': 0.2, "Sure thing": 0.9})
    b = ScriptedSession([([b"Sure", b" thing"], False)], {'{"ok": true}': 0.2, "Sure thing": 0.9})
    members = [ScriptedMember("a", a, capabilities=Capabilities(constrained=True)), ScriptedMember("b", b)]
    options = FusionOptions.build(exit=False, hedge=False, gate=None, guard=False, accept_margin=None)
    events = list(fuse(members, FusionRequest.of("q", options, constraint=Constraint.json_object())))
    result = events[-1].result
    assert result.text == '{"ok": true}' and result.valid is True and result.invalid_reason is None
    assert result.rounds[0].candidates[result.rounds[0].winner_index].model == "a"
    assert a.constraint is not None  # the member that can constrain was told to


def test_a_constraint_needs_a_member_that_can_draft_under_it():
    from segfuse.constraints import Constraint

    members = [ScriptedMember("remote", ScriptedSession([], {}))]
    with pytest.raises(InvalidRequestError) as caught:
        list(fuse(members, FusionRequest.of("q", FusionOptions.build(), constraint=Constraint.json_object())))
    assert "remote" in caught.value.message


def test_under_a_constraint_members_that_cannot_draft_under_it_only_verify():
    from segfuse.backends.base import Capabilities
    from segfuse.constraints import Constraint

    a = ConstrainedSession([([b'{"a"', b": 1}"], True)], {'{"a": 1}': 0.5})
    remote = ScriptedSession([([b"prose"], False)], {'{"a": 1}': 0.6})
    members = [
        ScriptedMember("a", a, capabilities=Capabilities(constrained=True), n_params=1),
        ScriptedMember("remote", remote, n_params=10**9),
    ]  # the largest, yet it cannot lead here
    for gate in (None, 0.5):
        a.drafts, remote.drafted = [([b'{"a"', b": 1}"], True)], 0
        options = FusionOptions.build(gate=gate, accept_margin=None, exit=False, hedge=False, guard=False)
        result = list(fuse(members, FusionRequest.of("q", options, constraint=Constraint.json_object())))[-1].result
        assert result.text == '{"a": 1}' and result.valid is True
        assert remote.drafted == 0  # it verified (voted) but never drafted
