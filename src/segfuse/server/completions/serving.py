"""``POST /v1/completions``: text completions, the legacy OpenAI endpoint.

Every member continues the prompt as it is, with no chat template (a base
model's natural task); the fusion is the same as for chat. A list of prompts
is answered one choice each (run side by side, as slots allow); streaming takes
one prompt. ``logprobs`` (up to 5) reports each answer token as its author
drafted it; ``echo`` puts the prompt before the answer's text, and with ``logprobs`` its tokens
too (``echo.py``; ``max_tokens: 0``: the prompt alone).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...logprobs import TokenLogprob, answer_logprobs
from ...options import FusionOptions
from ...request import FusionRequest
from ...types import Message, PromptToken, Result, SegmentEvent
from .. import parsing
from ..answer import Answer
from ..limits import check_text
from ..loading import streamed
from ..models.pool import Lease
from ..parsing import Endpoint, fusion_options
from ..serving import APIError, disconnected, finish_reason_of, finished, sse, usage_of
from ..state import ServerState, job_for, require_members, submit, using
from ..wire import FusionInfo, Usage
from ..worker.jobs import Job, Started
from .echo import echo_logprobs, joined, prompt_texts, read_prompts, shaped
from .protocol import (
    COMPLETION_NEUTRAL,
    COMPLETION_PARAMETERS,
    MODEL_PATH,
    PATH,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    TextCompletion,
)

COMPLETIONS = Endpoint(CompletionRequest, COMPLETION_PARAMETERS, COMPLETION_NEUTRAL, check_text)


async def answer(state: ServerState, request: Request, path_model: str | None = None) -> Response:
    """A text completion (`path_model`: the model its path names; the body may name only that one)."""
    body = await state.body(request)
    parsed = await state.offload(parsing.parse_request, body, COMPLETIONS, state.config.limits)
    detailed = state.holds_key(request)
    require_members(state, detailed)
    if path_model is not None and parsed.model not in (None, path_model):
        raise APIError(
            400,
            f"this path serves {path_model!r}, the body asks for {parsed.model!r}",
            code="invalid_value",
            param="model",
        )
    model = path_model or parsed.model or state.model_id
    start = partial(_start, state, request, parsed, model, detailed)
    echo_only = parsed.echo and parsed.logprobs is not None and parsed.max_tokens == 0
    if parsed.stream and not echo_only:
        return await streamed(state, model, parsed.keep_alive, start, CompletionAnswer)
    async with using(state, model, parsed.keep_alive) as lease:
        if echo_only:
            texts, _ = await _jobs(state, parsed, model, lease)
            echoes = await read_prompts(state, request, parsed, lease, detailed)
            return JSONResponse(echoed_only(parsed, model, texts, echoes).model_dump(mode="json"))
        reply, cancel = await start(lease)
    if parsed.stream:
        return reply.response(cancel)
    return JSONResponse(await reply.whole(disconnected(request), state.queue.cancel))


async def _jobs(state: ServerState, parsed: CompletionRequest, model: str, lease: Lease) -> tuple[list[str], list[Job]]:
    """Each prompt as text (token ids spelled out by the lease's members) and its job."""
    texts = await state.offload(prompt_texts, state.members_of(lease), parsed)
    name = f"cmpl-{uuid.uuid4().hex}"  # the response's id: the first job's
    jobs = [
        job_for(
            generation,
            lease,
            id=name if i == 0 else f"{name}-{i}",
            logprobs=parsed.logprobs is not None,
            streamed=bool(parsed.stream),
        )
        for i, generation in enumerate(requests_of(parsed, texts, state.defaults.of(model)))
    ]
    return list(texts), jobs


async def _start(
    state: ServerState, request: Request, parsed: CompletionRequest, model: str, detailed: bool, lease: Lease
) -> tuple[Answer, Callable[[], None]]:
    """The request's jobs queued under `lease` (each prompt takes a place in the queue: all of them fit, or
    the request is refused whole), and its answer."""
    texts, jobs = await _jobs(state, parsed, model, lease)
    echoes = None
    if parsed.echo and parsed.logprobs is not None:
        echoes = await read_prompts(state, request, parsed, lease, detailed)
    cancel = submit(state, jobs, lease, detailed, parsed.user, param="prompt")
    return CompletionAnswer(jobs, parsed, texts, model, detailed, echoes), cancel


def requests_of(request: CompletionRequest, texts: Sequence[str], defaults: FusionOptions) -> list[FusionRequest]:
    """The generation of each prompt (`texts`: each as text), a raw prompt continued as it is; 400 for what
    the endpoint cannot do."""
    if request.stream and len(texts) > 1:
        raise APIError(
            400,
            "a stream answers one prompt: send the prompts one by one, or stream: false",
            code="invalid_value",
            param="prompt",
        )
    if not all(texts):
        raise APIError(400, "a prompt is empty: give the text to continue", code="invalid_value", param="prompt")
    options = fusion_options(request, defaults)
    return [
        FusionRequest.of(
            [Message("raw", text)], options, top_logprobs=request.logprobs or 0, cache_salt=request.cache_salt
        )
        for text in texts
    ]


def echoed_only(
    request: CompletionRequest, model: str, texts: Sequence[str], echoes: Sequence[Sequence[PromptToken]]
) -> TextCompletion:
    """``max_tokens: 0``: each prompt with its tokens' log-probabilities, and no answer."""
    k = request.logprobs or 0
    choices = [
        CompletionChoice(index=i, text=text, logprobs=echo_logprobs(echo, k), finish_reason="length")
        for i, (text, echo) in enumerate(zip(texts, echoes))
    ]
    count = sum(len(e) for e in echoes)
    return TextCompletion(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=Usage(prompt_tokens=count, completion_tokens=0, total_tokens=count),
    )


def legacy_logprobs(tokens: Sequence[TokenLogprob], k: int, offset: int) -> CompletionLogprobs:
    """Answer tokens in the completions shape; `offset`: characters before the answer (an echoed prompt)."""
    return shaped(tokens, [_alternatives(t, k) for t in tokens], offset)


def _alternatives(token: TokenLogprob, k: int) -> dict[str, float]:
    """The author's top `k` as text -> log-probability (two tokens with one text: the likelier)."""
    table: dict[str, float] = {}
    for text, _, lp in token.top[:k]:
        table.setdefault(text, lp)
    return table


def _usage(outcomes: Sequence[tuple[Result, Started | None]]) -> Usage:
    """Every prompt's usage (``serving.usage_of``: each job's result with its own start), summed."""
    each = [usage_of(result, started) for result, started in outcomes]
    prompt, answer = sum(u.prompt_tokens for u in each), sum(u.completion_tokens for u in each)
    return Usage(prompt_tokens=prompt, completion_tokens=answer, total_tokens=prompt + answer)


class CompletionAnswer(Answer):
    """A text completion: every prompt's answer (`texts`: the prompts, one job each), in order, one choice
    each; or the stream of one: the echoed prompt (if asked), one chunk per accepted segment, finish,
    [usage], [DONE]. `echoes`: each prompt's echoed tokens, reported before the answer's."""

    PATHS = (PATH, MODEL_PATH)

    def __init__(
        self,
        jobs: Sequence[Job],
        request: CompletionRequest,
        texts: Sequence[str],
        model: str,
        detailed: bool = False,
        echoes: Sequence[Sequence[PromptToken]] | None = None,
    ) -> None:
        super().__init__(jobs[0], model, detailed)
        self.jobs, self.request, self.texts, self.echoes = list(jobs), request, texts, echoes
        self.offset = len(texts[0]) if request.echo else 0  # characters before the next segment (an echo)

    # ----------------------------------------------------------------------- the whole answer

    async def whole(self, disconnected: Callable[[], Awaitable[None]], stop: Callable[[Job], None]) -> dict[str, Any]:
        """Every prompt's answer; `stop` cancels one job (client gone, or another prompt's answer failed)."""
        try:
            outcomes = await asyncio.gather(
                *(finished(job, disconnected, partial(stop, job), self.detailed) for job in self.jobs)
            )
        finally:
            for job in self.jobs:
                stop(job)  # a no-op for those that ended
        first, self.started = outcomes[0]
        choices = [self._choice(i, result) for i, (result, _) in enumerate(outcomes)]
        info = self.info(first) if len(self.jobs) == 1 else FusionInfo(members=first.models)
        completion = TextCompletion(**self.envelope(), choices=choices, usage=_usage(outcomes), segfuse=info)
        return completion.model_dump(mode="json")

    def _choice(self, index: int, result: Result) -> CompletionChoice:
        request = self.request
        before = self.texts[index] if request.echo else ""
        logprobs = (
            legacy_logprobs(result.logprobs(), request.logprobs, len(before)) if request.logprobs is not None else None
        )
        if self.echoes is not None:
            logprobs = joined(echo_logprobs(self.echoes[index], request.logprobs or 0), logprobs)
        return CompletionChoice(
            index=index, text=before + result.text, logprobs=logprobs, finish_reason=finish_reason_of(result)
        )

    # ----------------------------------------------------------------------- the answer as it is written

    def _chunk(self, choice: CompletionChoice, info: FusionInfo | None = None) -> str:
        body = TextCompletion(**self.envelope(), choices=[choice], segfuse=info)
        return sse(body.model_dump(mode="json", exclude={"usage"}))

    def opening(self) -> list[str]:
        return [self._chunk(CompletionChoice(text=self.texts[0]))] if self.request.echo else []

    def segment(self, event: SegmentEvent) -> list[str]:
        k = self.request.logprobs
        logprobs = legacy_logprobs(answer_logprobs([event.segment]), k, self.offset) if k is not None else None
        self.offset += len(event.segment.text)
        return [self._chunk(CompletionChoice(text=event.segment.text, logprobs=logprobs))]

    def done(self, result: Result) -> list[str]:
        finish = CompletionChoice(text="", finish_reason=finish_reason_of(result))
        frames = [self._chunk(finish, self.info(result))]
        if self.request.include_usage:
            usage = TextCompletion(**self.envelope(), choices=[], usage=self.usage(result))
            frames.append(sse(usage.model_dump(mode="json", exclude={"segfuse"})))
        return frames


__all__ = ["COMPLETIONS", "CompletionAnswer", "answer", "legacy_logprobs", "requests_of"]
