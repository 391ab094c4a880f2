"""Ollama's routes (``/api/...``); what they answer is ``serving``'s and ``cards``'."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...errors import SegfuseError
from ..models.catalog import Model
from ..parsing import Endpoint
from ..serving import APIError, api_error
from ..state import ServerState
from . import cards, serving
from .planning import model_name, parse
from .protocol import CHAT_PATH, GENERATE_PATH, OLLAMA_VERSION, ShowRequest

# Ollama's routes that manage model files: this server serves the models of its configuration.
MANAGING = {
    "/api/pull": "POST",
    "/api/push": "POST",
    "/api/create": "POST",
    "/api/copy": "POST",
    "/api/delete": "DELETE",
}
NO_EMBEDDINGS = "segfuse generates text; it has no embeddings: use an embedding model's own server"
NO_MANAGING = "segfuse serves the models named in its configuration (segfuse serve -m, --ensemble, --config)"
SHOW = Endpoint(ShowRequest, tuple(ShowRequest.model_fields), {})


def refused(status: int, why: str) -> Callable[[], Awaitable[None]]:
    """A route that answers every request with `status` and `why` (in Ollama's shape, as every /api/ path)."""

    async def refuse() -> None:
        raise APIError(status, why, code="not_implemented")

    return refuse


def model_of(state: ServerState, name: str | None) -> Model:
    """The model `name` names (None: the default); 404 naming the known ones for any other."""
    try:
        return state.catalog.model(name)
    except SegfuseError as exc:
        raise api_error(exc, detailed=True) from None


def api_router(state: ServerState) -> APIRouter:
    """Ollama's generation and model routes over `state` (the app adds the API key check)."""
    router = APIRouter()

    @router.post(CHAT_PATH)
    async def chat(request: Request) -> Response:
        return await serving.chat(state, request)

    @router.post(GENERATE_PATH)
    async def generate(request: Request) -> Response:
        return await serving.generate(state, request)

    @router.get("/api/tags")
    async def tags() -> JSONResponse:
        return JSONResponse(cards.tags(state.pool, state.started))

    @router.get("/api/ps")
    async def ps() -> JSONResponse:
        return JSONResponse(cards.ps(state.pool, state.started))

    @router.post("/api/show")
    async def show(request: Request) -> JSONResponse:
        asked: ShowRequest = parse(await state.body(request), SHOW, state.config.limits)
        model = model_of(state, model_name(asked.model or asked.name, state.catalog.models))
        return JSONResponse(cards.show(state.pool, model, state.started))

    for path in ("/api/embed", "/api/embeddings"):
        router.add_api_route(path, refused(501, NO_EMBEDDINGS), methods=["POST"])
    for path, method in MANAGING.items():
        router.add_api_route(path, refused(501, NO_MANAGING), methods=[method])
    return router


def version_router() -> APIRouter:
    """``GET /api/version``: open, as /health is (clients probe it to find the server; it tells nothing else)."""
    router = APIRouter()

    @router.get("/api/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": OLLAMA_VERSION})

    return router


__all__ = ["api_router", "version_router"]
