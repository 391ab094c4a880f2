"""Echoed prompts on ``/v1/completions``: ``echo`` with ``logprobs`` reports the prompt's tokens
with their log-probabilities and alternatives before the answer's (what lm-eval's
``local-completions`` sends for every multiple-choice question: ``max_tokens`` 1, or 0 for the
prompt alone).

A member model reads the prompt on its own tokens; ``segfuse`` reads it with every member and
writes the pool on its largest member's tokens (``echo.py``). Token-array prompts are token ids of
that same member (``/tokenize``). Each prompt is read by a work job on the worker thread.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from functools import partial
from itertools import accumulate

from fastapi import Request

from ...backends.base import Member
from ...echo import reader_of
from ...ensemble import Ensemble
from ...errors import InvalidRequestError
from ...logprobs import TokenLogprob
from ...request import FusionRequest
from ...types import PromptToken
from ..models.pool import Lease
from ..serving import APIError, disconnected, worked
from ..state import ServerState, job_for, submit
from .protocol import CompletionLogprobs, CompletionRequest


def prompt_texts(members: Sequence[Member], request: CompletionRequest) -> list[str]:
    """Each prompt as text: token arrays spelled by the reader's vocabulary (``reader_of`` the members
    that answer: the member alone, or the largest; 400 for an id outside it)."""
    texts = []
    for prompt in request.prompts:
        if isinstance(prompt, str):
            texts.append(prompt)
            continue
        texts.append(spelled(reader_of(members), prompt, "prompt"))
    return texts


def spelled(member: Member, ids: list[int], param: str) -> str:
    """The text `ids` spell in `member`'s vocabulary; a 400 naming `param` for an id outside it, or for a
    member that cannot read ids."""
    try:
        text = member.detokenize(ids)
    except InvalidRequestError as exc:
        raise APIError(400, exc.message, code="invalid_value", param=param) from None
    if text is None:
        raise APIError(400, f"{member.name} cannot read token ids: send text", code="invalid_value", param=param)
    return text


def _read(prompt: str | list[int], k: int, members: list[str] | None, ensemble: Ensemble) -> list[PromptToken]:
    """On the worker thread: the prompt as the members read it, pooled (``Ensemble.echo``)."""
    return ensemble.echo(prompt, top_k=k, members=members)[1]


async def read_prompts(
    state: ServerState, http: Request, request: CompletionRequest, lease: Lease, detailed: bool
) -> list[list[PromptToken]]:
    """Every prompt's echoed tokens, each read by a work job (all queued, or refused whole)."""
    if request.stream:
        raise APIError(
            400, "echo with logprobs is answered whole: send stream: false", code="invalid_value", param="stream"
        )
    members = lease.members
    k = request.logprobs or 0
    name = f"echo-{uuid.uuid4().hex}"
    # No generation: its work reads.
    reading = FusionRequest((), state.defaults.of(lease.model.name), cache_salt=request.cache_salt)
    jobs = [
        job_for(reading, lease, id=f"{name}-{i}", work=partial(_read, prompt, k, members))
        for i, prompt in enumerate(request.prompts)
    ]
    submit(state, jobs, lease, detailed, request.user, param="prompt")
    try:
        values = await asyncio.gather(
            *(worked(job, disconnected(http), partial(state.queue.cancel, job), detailed) for job in jobs)
        )
    finally:
        for job in jobs:
            state.queue.cancel(job)  # a no-op for those that ended
    return [_read_tokens(v) for v in values]


def _read_tokens(value: object) -> list[PromptToken]:
    assert isinstance(value, list)  # what _read returned
    return list(value)


def shaped(
    tokens: Sequence[PromptToken | TokenLogprob], tops: Sequence[dict[str, float] | None], offset: int = 0
) -> CompletionLogprobs:
    """Tokens in the completions shape, each with its alternatives `tops`; the first starts `offset` characters
    into the text."""
    return CompletionLogprobs(
        tokens=[t.text for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=list(tops),
        text_offset=list(accumulate((len(t.text) for t in tokens), initial=offset))[:-1],
    )


def echo_logprobs(tokens: Sequence[PromptToken], k: int) -> CompletionLogprobs:
    """The echoed prompt in the completions shape (the first token has no log-probability)."""
    return shaped(tokens, [dict(t.top[:k]) if t.logprob is not None else None for t in tokens])


def joined(echo: CompletionLogprobs, answer: CompletionLogprobs | None) -> CompletionLogprobs:
    """The echoed prompt's entries, then the answer's (its offsets already count the prompt's characters)."""
    if answer is None:
        return echo
    return CompletionLogprobs(
        tokens=echo.tokens + answer.tokens,
        token_logprobs=echo.token_logprobs + answer.token_logprobs,
        top_logprobs=echo.top_logprobs + answer.top_logprobs,
        text_offset=echo.text_offset + answer.text_offset,
    )


__all__ = ["echo_logprobs", "joined", "prompt_texts", "read_prompts", "shaped", "spelled"]
