"""The chat completions route; what it answers is ``serving``'s."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..state import ServerState
from . import serving
from .protocol import PATH


def api_router(state: ServerState) -> APIRouter:
    """``POST /v1/chat/completions`` over `state` (the app adds the API key check)."""
    router = APIRouter()

    @router.post(PATH)
    async def chat_completions(request: Request) -> Response:
        return await serving.answer(state, request)

    return router


__all__ = ["api_router"]
