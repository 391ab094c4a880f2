"""A llama.cpp member's KV-cache types and flash attention, as member options (`type_k`, `type_v`, `flash_attn`):
read and refused clearly wherever options are given, and a real member (smollm2) loaded with a q8_0 cache
answers, its cells taking about half the bytes of f16's."""

from __future__ import annotations

import llama_cpp as lc
import pytest

from segfuse import Ensemble
from segfuse.config import ServerConfig
from segfuse.errors import InvalidRequestError
from segfuse.member_options import MemberOptions

MEMBER = "smollm2-135m"


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"type_k": "q9_0"}, "type_k: Input should be 'f32', 'f16'"),
        ({"type_v": 8}, "type_v: Input should be"),
        ({"flash_attn": "sometimes"}, "flash_attn: Input should be 'auto', 'on' or 'off'"),
        ({"type_v": "q4_0", "flash_attn": "off"}, "type_v q4_0 needs flash_attn on or auto"),
    ],
)
def test_a_bad_cache_option_is_refused_naming_it(given, named):
    with pytest.raises(InvalidRequestError, match=named):
        MemberOptions.build(given)


def test_cache_options_are_read_from_every_place_options_come_from():
    read = MemberOptions.build({"type_k": "Q8_0", "type_v": "q8_0", "flash_attn": True})
    assert (read.type_k, read.type_v, read.flash_attn) == ("q8_0", "q8_0", "on")
    assert MemberOptions.build({"flash_attn": "no"}).flash_attn == "off"
    members = ServerConfig.model_validate({"members": {"type_k": "q4_0", "flash_attn": "auto"}}).members
    assert members.load_options().given()["type_k"] == "q4_0"
    with pytest.raises(InvalidRequestError, match="type_k: Input should be"):
        Ensemble([f"{MEMBER}#type_k=f8"])  # a spec's own, refused before anything loads


def state_bytes(member, tokens: int) -> int:
    """The bytes llama.cpp's state of one sequence takes once `tokens` prompt tokens sit in it."""
    context = member.context
    ids = member.vocab.tokenize_plain("The sea " * tokens)[:tokens]
    context.decode(ids, list(range(len(ids))), [0] * len(ids), [False] * (len(ids) - 1) + [True])
    size = int(lc.llama_state_seq_get_size(context._ctx, 0))
    context.clear()
    return size


@pytest.mark.models
def test_a_member_with_a_q8_0_cache_loads_answers_and_takes_half_the_bytes():
    options = {"threads": 1, "n_ctx": 256, "slots": 1, "prefix_cache_cells": 0}
    quantized = Ensemble([f"{MEMBER}#q8,type_k=q8_0,type_v=q8_0"], **options)
    plain = Ensemble([MEMBER], **options)
    try:
        answer = quantized.generate("Name a colour.", max_tokens=4, temperature=0)
        assert answer.text.strip() and answer.stats.tokens > 0
        assert quantized.members[0].kv.type_v == "q8_0"
        q8, f16 = state_bytes(quantized.members[0], 64), state_bytes(plain.members[0], 64)
        print(f"state of 64 tokens: f16 {f16} bytes, q8_0 {q8} bytes ({q8 / f16:.3f}x)")
        assert 0.45 < q8 / f16 < 0.6, (q8, f16)  # q8_0: 34 bytes per 32 values against 64
    finally:
        quantized.close()
        plain.close()
