"""``Member.echo`` beyond llama.cpp, on real models: a transformers member (SmolLM2-135M on CPU) and
remote members behind llama-cpp-python's server on loopback (Gemma 3 270M, whose texts start with
its BOS, and SmolLM2, whose do not).

Tolerances. A transformers echo and the same member's score of a continuation run the same fp32
weights on the same tokens, but in other batch shapes (one causal pass from the text's start
against a cached context plus a 4-D-masked candidate block): measured 1e-5 nats over 9 tokens,
allowed 1e-3 (float32 sums in another order, nothing more). A remote echo and the remote member's
score are the same request to the same server: allowed 1e-4. The remote echo against a local
llama.cpp member on the same GGUF (flash attention in both, one thread) is allowed 0.5 nats over
the continuation, as llama.cpp members on one text in other batch splits: measured 0.10 nats on
one token.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# The transformers member and the SmolLM2 server as test_backends_hf_remote makes them.
from members import loaded
from segfuse.backends.likelihood import score_continuations
from segfuse.backends.remote.echo import raw_echo_agrees
from segfuse.backends.transformers import echo as hf_echo
from segfuse.errors import InvalidRequestError, PromptTooLongError
from segfuse.models import CATALOGUE, is_ready, model_path
from segfuse.types import Message, PromptToken
from test_backends_hf_remote import hf_member, remote_member, server_url  # noqa: F401  # fixtures

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

GEMMA = CATALOGUE["gemma3-270m"]
CONTEXT = "The capital of France is"
CONTINUATION = " Paris, a city on the Seine."
SHORT = " Paris ☕."  # the cup is a character of three bytes
GEMMA_CTX = 128  # the Gemma server's window: llama-cpp-python keeps a logits row per cell (262k floats each)
ODD = "Un café ☕ à Zürich, naïve 日本語 — fin."  # multi-byte characters, some split across tokens


@pytest.fixture(scope="module")
def gemma_url(tmp_path_factory) -> Iterator[str]:
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server extra is not installed")
    if not is_ready(GEMMA):
        pytest.skip("Gemma 3 270M is not prepared")
    from segfuse.bench.common.processes import llama_cpp_server

    with llama_cpp_server(model_path(GEMMA), tmp_path_factory.mktemp("gemma") / "gemma.log", n_ctx=GEMMA_CTX) as server:
        yield server.url


@pytest.fixture(scope="module")
def gemma_remote(gemma_url):
    # Unprobed (trusted) here, to spare the load-time probes; the test below runs the plain-text one.
    with loaded(f"remote:{gemma_url}#gemma-remote,check_echo=false") as member:
        yield member


def _after(tokens: list[PromptToken], n_bytes: int) -> float:
    """Summed log-probabilities of the tokens that start at or after byte `n_bytes`."""
    return sum(t.logprob for t in tokens if t.start >= n_bytes)  # type: ignore[misc]  # only the first has none


def _check_alternatives(tokens: list[PromptToken], k: int) -> None:
    """Alternatives likeliest first, at most k, and none less likely than the token itself."""
    for token in tokens:
        if token.logprob is None:
            continue
        assert 0 < len(token.top) <= k
        values = [lp for _, lp in token.top]
        assert values == sorted(values, reverse=True)
        assert token.logprob <= values[0] + 1e-5


# --- transformers ------------------------------------------------------------------------------


def test_hf_echo_spells_the_text_and_equals_its_score(hf_member):  # noqa: F811  # the imported fixture
    assert hf_member.capabilities.echo
    tokens = hf_member.echo(CONTEXT + CONTINUATION, top_k=3)
    assert "".join(t.text for t in tokens) == CONTEXT + CONTINUATION
    assert [t.id for t in tokens] == hf_member.tokenize_text(CONTEXT + CONTINUATION)
    assert hf_member.vocab.text_prefix == []  # SmolLM2 reads no BOS: nothing predicts the first token
    assert tokens[0].logprob is None and all(t.logprob is not None for t in tokens[1:])
    _check_alternatives(tokens, 3)
    scored = score_continuations(hf_member, CONTEXT, [CONTINUATION])[0]
    assert abs(_after(tokens, len(CONTEXT.encode())) - scored.logprob) < 1e-3
    assert sum(t.start >= len(CONTEXT) for t in tokens) == scored.tokens


def test_hf_echo_of_multibyte_text_and_its_ids(hf_member):  # noqa: F811  # the imported fixture
    tokens = hf_member.echo(ODD, top_k=1)
    assert "".join(t.text for t in tokens) == ODD
    assert tokens[-1].end == len(ODD.encode())
    ids = hf_member.tokenize_text(ODD)
    assert hf_member.detokenize(ids) == ODD
    again = hf_member.echo(ids, top_k=1)  # the same ids given as ids: the same numbers
    assert [(t.text, t.logprob) for t in again] == [(t.text, t.logprob) for t in tokens]


def test_hf_echo_in_small_chunks_equals_one_pass(hf_member, monkeypatch):  # noqa: F811  # the imported fixture
    whole = hf_member.echo(CONTEXT + CONTINUATION, top_k=2)
    monkeypatch.setattr(hf_echo, "MAX_CHUNK", 3)  # rows read three tokens at a time
    pieces = hf_member.echo(CONTEXT + CONTINUATION, top_k=2)
    assert [t.text for t in pieces] == [t.text for t in whole]
    for a, b in zip(pieces[1:], whole[1:]):
        assert abs(a.logprob - b.logprob) < 1e-3  # type: ignore[operator]  # after the first, all have one
        assert a.top[0][0] == b.top[0][0]


def test_hf_echo_refuses_bad_input(hf_member):  # noqa: F811  # the imported fixture
    with pytest.raises(PromptTooLongError, match="context window"):
        hf_member.echo("a " * (hf_member.n_ctx + 10))
    with pytest.raises(InvalidRequestError, match=str(hf_member.vocab.n_vocab + 5)):
        hf_member.echo([1, hf_member.vocab.n_vocab + 5])
    with pytest.raises(InvalidRequestError, match="-1"):
        hf_member.detokenize([-1])


# --- remote ------------------------------------------------------------------------------------
# llama-cpp-python sorts the whole vocabulary in Python for every echoed token (about 1 s a token
# with Gemma's 262k): the remote texts stay a few tokens long.


def test_remote_echo_spells_the_text_and_equals_its_score(gemma_remote):
    assert raw_echo_agrees(gemma_remote.server)  # Gemma's texts start with its BOS: the server echoes them right
    tokens = gemma_remote.echo(CONTEXT + SHORT, top_k=3)
    assert "".join(t.text for t in tokens) == CONTEXT + SHORT
    assert tokens[0].logprob is None  # the server hides the BOS and reports nothing for the first token
    assert all(t.logprob is not None for t in tokens[1:])
    _check_alternatives(tokens, 3)
    after = _after(tokens, len(CONTEXT.encode()))
    scored = score_continuations(gemma_remote, CONTEXT, [SHORT])[0]
    assert abs(after - scored.logprob) < 1e-4
    with loaded("gemma3-270m", threads=1) as local:
        mine = local.echo(CONTEXT + SHORT)
    assert [t.text for t in mine] == [t.text for t in tokens]
    assert abs(_after(mine, len(CONTEXT.encode())) - after) < 0.5
    assert gemma_remote.tokenize_text(ODD) is None


def test_remote_echo_refuses_ids_and_over_window_texts(gemma_url, gemma_remote):
    with pytest.raises(InvalidRequestError, match="text only"):
        gemma_remote.echo([1, 2, 3])
    with loaded(f"remote:{gemma_url}#gemma-narrow,n_ctx={GEMMA_CTX},check_echo=false") as narrow:
        with pytest.raises(PromptTooLongError, match="context window"):
            narrow.echo("x " * 1000)  # the server refuses it before reading it


def test_remote_echo_refused_where_the_server_shifts_it(remote_member):  # noqa: F811  # the imported fixture
    """SmolLM2's plain texts do not start with its BOS: llama-cpp-python would shift every echoed
    log-probability by one token (abetlen/llama-cpp-python#1983), so the member does not offer echo at all."""
    assert not remote_member.capabilities.echo
    with pytest.raises(InvalidRequestError, match="1983"):
        remote_member.echo(CONTEXT)
    with pytest.raises(InvalidRequestError, match="1983"):  # a text completion's scores would be shifted too
        remote_member.start([Message("raw", CONTEXT)], seed=None, reserve=4)
