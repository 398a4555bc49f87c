"""The FastAPI app: the wire APIs' routes (OpenAI, Responses, Anthropic, Ollama) over one AsyncEngine, plus
/health, /metrics and errors.

The model is loaded before the app is built (kvflow serve opens its port only once the model is ready),
and the engine thread runs for the app's lifespan: started at startup, stopped at shutdown, after the
server has let the streams in flight finish.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow import __version__
from kvflow.engine.async_engine import AsyncEngine
from kvflow.server import (
    anthropic_api,
    completions_api,
    ollama_api,
    openai_api,
    openapi,
    page_api,
    responses_api,
    tokenize_api,
)
from kvflow.server.errors import APIError, error_response
from kvflow.server.metrics import CONTENT_TYPE
from kvflow.server.serving import (
    APIKeyMiddleware,
    RequestIdMiddleware,
    RootPathMiddleware,
    ServerSettings,
    ServerState,
    get_state,
    metrics_state,
    validation_error,
)

log = logging.getLogger("kvflow")


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    state = ServerState(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="kvflow", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    openapi.install(app)
    app.state.kvflow = state
    app.include_router(openai_api.router)
    app.include_router(completions_api.router)
    app.include_router(ollama_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(page_api.router)
    _add_basic_routes(app)
    _add_error_handlers(app, state)
    # The key is checked before any route runs; the body's size limit as a route reads it (serving.read_body).
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, on_error=_error_counter(state))
    app.add_middleware(RequestIdMiddleware)
    if settings.root_path.strip("/"):
        app.add_middleware(RootPathMiddleware, prefix=settings.root_path)
    return app


def _error_counter(state: ServerState):
    return lambda error: state.metrics.count_error(error.kind)


def _add_basic_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        engine = get_state(request).engine
        return PlainTextResponse(engine.status, status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(metrics_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        state.metrics.count_error(exc.kind)
        return error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), None, None, dict(exc.headers or {}))
        return await api_error(request, error)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, APIError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(ValidationError)
    async def model_validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        # A model validated while handling the request (a part of the body read again as another request's
        # shape, as /tokenize reads its messages as a chat request's): the client's input, not a fault.
        return await api_error(request, validation_error(exc))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
