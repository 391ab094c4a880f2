"""The Responses API's route; what it answers is ``serving``'s."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..state import ServerState
from . import serving
from .protocol import PATH


def api_router(state: ServerState) -> APIRouter:
    """``POST /v1/responses`` over `state` (the app adds the API key check), with the app's store of
    responses a later request may continue."""
    router = APIRouter()
    store = state.extras["responses"] = state.shared.responses  # what previous_response_id finds

    @router.post(PATH)
    async def responses(request: Request) -> Response:
        return await serving.answer(state, store, request)

    return router


__all__ = ["api_router"]
