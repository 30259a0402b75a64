"""The HTTP server on one Engine (and optionally a smaller fallback one), or on a pool of models
loaded when asked (engine/pool.py): its routes and error shapes.

create_app(settings, engine) or create_app(settings, pool=pool) builds a Starlette app whose
state lives in one dispatch.Dispatcher (models, leases, admission, failover), so several apps
can share a process, even an engine. Each API is a translator module of its own onto that
dispatcher (openai_chat_api, openai_responses_api, anthropic_api, ollama_api, llamacpp_api,
embeddings_api, audio_api), answering through streaming.py; an error is answered in the shape of the API
whose path was called. The API key is checked in auth.py, browsers' preflights in cors.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgechat import sysmem
from edgechat.engine.pool import ModelPool
from edgechat.engine.speech.models import SpeechModels
from edgechat.errors import InvalidFieldError
from edgechat.server import (
    anthropic_api,
    audio_api,
    embeddings_api,
    llamacpp_api,
    ollama_api,
    openai_chat_api,
    openai_responses_api,
)
from edgechat.server.auth import BearerAuth
from edgechat.server.cors import Cors
from edgechat.server.dispatch import Dispatcher
from edgechat.server.errors import ApiError, field_error
from edgechat.server.settings import ServerSettings

log = logging.getLogger("edgechat.server")


async def _health(dispatcher: Dispatcher, request: Request) -> Response:
    # an engine given to the server loaded cannot be loaded again: once its thread died, every
    # request would fail, and a supervisor reading /health should restart the process
    dead = [m.name for m in dispatcher.pool.resident() if m.pinned and m.engine is not None and m.engine.stopped]
    if dead:
        return JSONResponse({"status": "error", "model": dispatcher.primary.id, "stopped": dead}, status_code=503)
    memory = sysmem.read()
    return JSONResponse({"status": "ok", "model": dispatcher.primary.id, **dispatcher.stats(), "degraded": dispatcher.degrade.active,
                         "memory": dataclasses.asdict(memory)})


async def _metrics(dispatcher: Dispatcher, request: Request) -> Response:
    body = dispatcher.metrics.render(dispatcher.stats(), dispatcher.degrade.active, dispatcher.gate.snapshot() if dispatcher.gate else {}, dispatcher.pool.resident(),
                                 sysmem.read())
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


#: each API's error shape by the paths it serves; OpenAI's everywhere else
_ERROR_SHAPES = ((ollama_api.owns, ollama_api.error_response), (llamacpp_api.owns, llamacpp_api.error_response),
                 (anthropic_api.owns, anthropic_api.error_response))


def error_response(path: str, exc: ApiError) -> Response:
    for owns, render in _ERROR_SHAPES:
        if owns(path):
            return render(exc)
    return exc.response()


async def _api_error(request: Request, exc: ApiError) -> Response:
    return error_response(request.url.path, exc)


async def _field_error(request: Request, exc: InvalidFieldError) -> Response:
    return error_response(request.url.path, field_error(exc))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(request.url.path, ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request.url.path, ApiError(500, "internal server error", type="server_error"))


def create_app(settings: ServerSettings, engine=None, fallback=None, pool: ModelPool | None = None,
               speech: SpeechModels | None = None) -> Starlette:
    """The ASGI app serving `engine` (and, while degraded, `fallback`: a smaller model's engine,
    or the name of one in the pool), every model of `pool` (loaded when a request names one,
    unloaded when idle), and the `speech` models on the audio endpoints.

    It owns neither: the caller closes the engines and the pool.
    """
    dispatcher = Dispatcher(settings, engine, fallback, pool, speech)
    routes = [
        Route("/health", functools.partial(_health, dispatcher), methods=["GET"]),
        Route("/metrics", functools.partial(_metrics, dispatcher), methods=["GET"]),
        *openai_chat_api.ChatApi(dispatcher).routes(),
        *ollama_api.OllamaApi(dispatcher).routes(),
        *llamacpp_api.LlamaCppApi(dispatcher).routes(),
        *anthropic_api.MessagesApi(dispatcher).routes(),
        *openai_responses_api.ResponsesApi(dispatcher).routes(),
        *embeddings_api.EmbeddingsApi(dispatcher).routes(),
        *audio_api.AudioApi(dispatcher).routes(),
    ]
    # CORS outside the key check: a browser's preflight carries no key
    cors = [Middleware(Cors, origins=settings.cors_origins, render=error_response)] if settings.cors_origins else []
    app = Starlette(
        routes=routes,
        middleware=[*cors, Middleware(BearerAuth, api_key=settings.api_key, key_classes=settings.key_classes, render=error_response)],
        # starlette types every handler as taking Exception, though it calls each with the class it is keyed by
        exception_handlers={ApiError: _api_error, InvalidFieldError: _field_error, HTTPException: _http_error,  # type: ignore[dict-item]
                            Exception: _server_error},
    )
    app.state.dispatcher = dispatcher
    return app

