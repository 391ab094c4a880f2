"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, as vLLM and llama.cpp's server offer them.

A model's tokens: a member model's own; ``segfuse``'s are its largest member's, the member whose
tokens an echoed prompt is written on (``echo.py``). lm-eval's ``local-completions``
finds these routes beside ``/v1/completions`` (its ``remote`` tokenizer) and sends token-array prompts
in them, so that its context/continuation split is the server's. Bodies are bounded like the others'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request

from ...backends.base import Member
from ...echo import reader_of
from .. import parsing
from ..limits import exceeded
from ..parsing import Endpoint
from ..serving import APIError
from ..state import ServerState, require_members, using
from .echo import spelled
from .protocol import DetokenizeRequest, TokenizeRequest


def _check_tokenize(request: TokenizeRequest, limits: Any) -> None:
    if len(request.prompt) > limits.max_content_chars:
        raise exceeded("prompt", f"{len(request.prompt):,} characters", limits.max_content_chars, "max_content_chars")


def _check_detokenize(request: DetokenizeRequest, limits: Any) -> None:
    if len(request.tokens) > limits.max_content_chars:
        raise exceeded("tokens", f"{len(request.tokens):,} tokens", limits.max_content_chars, "max_content_chars")


TOKENIZE = Endpoint(TokenizeRequest, tuple(TokenizeRequest.model_fields), {}, _check_tokenize)
DETOKENIZE = Endpoint(DetokenizeRequest, tuple(DetokenizeRequest.model_fields), {}, _check_detokenize)


def _tokens(member: Member, request: TokenizeRequest) -> list[int]:
    ids = member.tokenize_text(request.prompt)
    if ids is None:
        raise APIError(400, f"{member.name} cannot tokenize here", code="invalid_value", param="model")
    return member.lead_tokens() + ids if request.add_special_tokens else ids


async def _by_reader(state: ServerState, request: Request, model: str | None, work: Callable[..., Any]) -> Any:
    """`work(reader)` off the event loop, the model's members loaded and held meanwhile; the reader is
    the member alone, or the largest."""
    require_members(state, state.holds_key(request))
    async with using(state, model or state.model_id) as lease:
        return await state.offload(work, reader_of(state.members_of(lease)))


async def tokenize(state: ServerState, request: Request, path_model: str | None = None) -> dict[str, Any]:
    """``/tokenize``: the prompt's token ids (`path_model`: the model its path names)."""
    body = await state.body(request)
    parsed = await state.offload(parsing.parse_request, body, TOKENIZE, state.config.limits)

    def read(member: Member) -> dict[str, Any]:
        tokens = _tokens(member, parsed)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": getattr(member, "n_ctx", None)}

    result: dict[str, Any] = await _by_reader(state, request, path_model or parsed.model, read)
    return result


async def detokenize(state: ServerState, request: Request, path_model: str | None = None) -> dict[str, Any]:
    """``/detokenize``: the text token ids spell."""
    body = await state.body(request)
    parsed = await state.offload(parsing.parse_request, body, DETOKENIZE, state.config.limits)
    text = await _by_reader(state, request, path_model or parsed.model, lambda m: spelled(m, parsed.tokens, "tokens"))
    return {"prompt": text}


async def tokenizer_info(state: ServerState, request: Request, model: str | None = None) -> dict[str, Any]:
    """``/tokenizer_info``: whose tokens a model's are, its special tokens, template and window."""
    info: dict[str, Any] = await _by_reader(state, request, model, lambda member: _info(state, model, member))
    return info


def _info(state: ServerState, model: str | None, member: Member) -> dict[str, Any]:
    return {
        "model": model or state.model_id,
        "tokenizer_of": member.name,
        "bos_token": (getattr(member, "bos_text", None) or None) if member.lead_tokens() else None,
        "eos_token": getattr(member, "eos_text", None) or None,
        "pad_token": None,
        "chat_template": getattr(member, "chat_template", None),
        "model_max_length": getattr(member, "n_ctx", None),
    }


__all__ = ["DETOKENIZE", "TOKENIZE", "detokenize", "tokenize", "tokenizer_info"]
