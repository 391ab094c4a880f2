"""``Member.echo`` for a remote member: the server's own echo of a text (``/v1/completions`` with
``echo`` and ``logprobs``), checked before it is trusted.

What a server reports is taken as it is only where it spells the text: the echoed prompt tokens'
pieces must join to the text exactly, else the echo is refused (never numbers on other tokens).
A leading BOS the server lists (vLLM lists the tokens it read) is dropped; the token after it keeps
its log-probability given the BOS. Servers that hide the BOS (llama-cpp-python) report no
log-probability for the first token: it stays None. Whether a server echoes a plain text right at
all is probed once when the member loads (:func:`raw_echo_agrees`): llama-cpp-python shifts every
echoed log-probability by one token when the text does not start with its BOS
(abetlen/llama-cpp-python#1983).
"""

from __future__ import annotations

from typing import Any

from ...errors import InvalidRequestError, PromptTooLongError
from ...types import PromptToken
from .http import RemoteServerError
from .logprobs import Entry, choices_of, entries_of, known_logprobs, pieces_of
from .server import Server

PROBE_TEXT = "The capital of France is"
"""A plain text (no BOS, no template) whose greedy continuation the load-time probe echoes back."""


def same_logprobs(got: list[float], want: list[float]) -> bool:
    """Echoed and generated log-probabilities of the same tokens agree (servers batch differently)."""
    return len(got) == len(want) and all(abs(a - b) <= 0.1 + 0.1 * abs(b) for a, b in zip(got, want))


def echoed_match(echoed: list[Entry], generated: list[Entry]) -> list[float] | None:
    """The echoed log-probabilities of the `generated` tokens, found by their texts from the end (a
    faulty server also drops the last entry, so counts are not trusted); None when not found."""
    tokens = [e.token for e in generated]
    at = next(
        (
            i
            for i in range(len(echoed) - len(tokens), -1, -1)
            if [e.token for e in echoed[i : i + len(tokens)]] == tokens
        ),
        None,
    )
    return None if at is None else known_logprobs(echoed[at : at + len(tokens)])


def echo_probe(server: Server, prompt: str) -> tuple[list[float], list[float]] | None:
    """Three greedy tokens after `prompt`, then the echo of prompt and tokens: (echoed, generated)
    log-probabilities of those tokens; None when there is nothing to compare (no tokens, or the echo
    re-tokenized them differently)."""
    gen = server.complete(prompt, max_tokens=3, temperature=0.0, top_p=1.0, seed=0)
    text = gen.get("text") or ""
    generated = [e for e in entries_of(gen.get("logprobs")) if e.logprob is not None] if text else []
    if not generated:
        return None
    got = echoed_match(server.echo([prompt + text])[0].entries, generated)
    wanted = known_logprobs(generated)  # all there: `generated` keeps only the tokens that have one
    return None if got is None or wanted is None else (got, wanted)


def raw_echo_agrees(server: Server) -> bool:
    """Whether the server's echo of a plain text gives the log-probabilities it generated with (nothing
    to compare, or a failed probe: not shown to work)."""
    try:
        found = echo_probe(server, PROBE_TEXT)
    except RemoteServerError:
        return False
    return found is not None and same_logprobs(*found)


def shifted(server: Server, what: str) -> InvalidRequestError:
    """The error for what a server that shifts a plain text's echo (abetlen/llama-cpp-python#1983) cannot do right."""
    return InvalidRequestError(
        f"{server.name}: {server.url} shifts the log-probabilities of a text it reads with "
        f"no BOS first (abetlen/llama-cpp-python#1983), so it cannot {what}",
        "serve this model with vLLM or a fixed llama-cpp-python",
    )


def _request(server: Server, text: str, top_k: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model,
        "prompt": text,
        "max_tokens": server.kind.echo_max_tokens,
        "temperature": 0.0,
        "logprobs": max(top_k, 1),
        "echo": True,
        "stream": False,
    }
    try:
        data = server.client.post("/completions", body)
    except RemoteServerError as exc:
        if len(text.encode("utf-8")) + server.kind.echo_max_tokens > server.n_ctx:  # it may well be over the window
            raise PromptTooLongError(
                f"{server.name} could not read the text, which may be over its context window "
                f"({server.n_ctx} tokens): {exc}",
                "shorten the text",
            ) from None
        raise
    choice = choices_of(data, 1)[0]
    choice["_usage"] = data.get("usage") or {}
    return choice


def _alternatives(listed: Any, k: int) -> tuple[tuple[str, float], ...]:
    """A server's top log-probabilities at one position as (text, log-probability), likeliest first."""
    if k <= 0 or not isinstance(listed, dict):
        return ()
    ranked = sorted(((str(t), float(lp)) for t, lp in listed.items()), key=lambda p: -p[1])
    return tuple(ranked[:k])


def echo_remote(server: Server, text: str, top_k: int, bos: str = "") -> list[PromptToken]:
    """`text`'s tokens as `server` reads them, with their log-probabilities and `top_k` alternatives (`bos`: the
    text of the BOS the server may read first)."""
    if not text:
        return []
    choice = _request(server, text, top_k)
    entries = entries_of(choice.get("logprobs"))
    tops = list((choice.get("logprobs") or {}).get("top_logprobs") or [None] * len(entries))
    n_gen = server.kind.echo_max_tokens
    completed = choice["_usage"].get("completion_tokens")
    if isinstance(completed, int):
        n_gen = min(completed, n_gen)  # llama-cpp-python lists no end-of-generation token
    entries, tops = entries[: len(entries) - n_gen], tops[: len(entries) - n_gen]
    if len(entries) > 1 and bos and entries[0].token == bos and not text.startswith(bos):
        entries, tops = entries[1:], tops[1:]  # the BOS the server read first (not echoed)
    if len(entries) + n_gen > server.n_ctx:
        raise PromptTooLongError(
            f"{server.name}: the text is {len(entries)} tokens, over its context window ({server.n_ctx})",
            "shorten the text",
        )
    try:
        pieces = pieces_of(text, entries)
    except RemoteServerError:
        pieces = []
    if "".join(pieces) != text:
        raise RemoteServerError(
            f"{server.name}: the server's echoed tokens do not spell the text",
            "its echo cannot be attributed to the text; ask another member",
        )
    out: list[PromptToken] = []
    at = 0
    for entry, piece, listed in zip(entries, pieces, tops):
        end = at + len(piece.encode("utf-8"))
        out.append(PromptToken(None, piece, at, end, entry.logprob, _alternatives(listed, top_k)))
        at = end
    return out


def refuse_ids(name: str) -> InvalidRequestError:
    """The error for token ids given to member `name`, whose tokenizer is the server's."""
    return InvalidRequestError(
        f"{name} reads text only: its server's token ids are unknown here", "give the prompt as text", field="prompt"
    )


__all__ = [
    "PROBE_TEXT",
    "echo_probe",
    "echo_remote",
    "echoed_match",
    "raw_echo_agrees",
    "refuse_ids",
    "same_logprobs",
    "shifted",
]
