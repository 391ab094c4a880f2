"""The text completions routes and the tokenizer routes beside them; what they answer is ``serving``'s and
``tokenize``'s."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..state import ServerState
from . import serving
from . import tokenize as tokens
from .protocol import MODEL_PATH, PATH


def api_router(state: ServerState) -> APIRouter:
    """``/v1/completions``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info``, and each beside one model's
    own ``/m/{model}/v1/completions``, over `state` (the app adds the API key check)."""
    router = APIRouter()

    @router.post(PATH)
    async def text_completions(request: Request) -> Response:
        return await serving.answer(state, request)

    # One model's own path (its tokens in /m/{model}/tokenize beside it): lm-eval's remote tokenizer
    # finds the tokenizer next to the completions URL and names no model.
    @router.post(MODEL_PATH)
    async def model_text_completions(request: Request, model: str) -> Response:
        return await serving.answer(state, request, model)

    async def tokenize(request: Request, path_model: str | None = None) -> dict[str, Any]:
        return await tokens.tokenize(state, request, path_model)

    async def detokenize(request: Request, path_model: str | None = None) -> dict[str, Any]:
        return await tokens.detokenize(state, request, path_model)

    async def tokenizer_info(request: Request, model: str | None = None) -> dict[str, Any]:
        return await tokens.tokenizer_info(state, request, model)

    # The server's own model's tokens, and one model's beside its /m/{model}/v1/completions.
    router.post("/tokenize")(tokenize)
    router.post("/detokenize")(detokenize)
    router.get("/tokenizer_info")(tokenizer_info)
    router.post("/m/{path_model}/tokenize")(tokenize)
    router.post("/m/{path_model}/detokenize")(detokenize)
    router.get("/m/{model}/tokenizer_info")(tokenizer_info)
    return router


__all__ = ["api_router"]
