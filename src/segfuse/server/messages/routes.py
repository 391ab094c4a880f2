"""The Messages API's routes; what they answer is ``serving``'s."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..state import ServerState
from . import serving
from .protocol import PATH


def api_router(state: ServerState) -> APIRouter:
    """``POST /v1/messages`` and ``/v1/messages/count_tokens`` over `state` (the app adds the API key check)."""
    router = APIRouter()

    @router.post(PATH)
    async def messages(request: Request) -> Response:
        return await serving.answer(state, request)

    @router.post(f"{PATH}/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        return await serving.count_tokens(state, request)

    return router


__all__ = ["api_router"]
