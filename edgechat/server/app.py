"""The OpenAI-compatible HTTP API on an Engine (and optionally a smaller fallback one).

create_app(settings, engine) builds a Starlette app whose state lives in one _Server object, so
several apps can share a process, even an engine. Each HTTP request becomes one
engine.submit(), followed on the event loop through a bridge.Generation. The engine does the
batching; this layer routes, parses, admits, streams, cancels on disconnect or timeout, and
counts. Response bodies are built in responses.py, the API key is checked in auth.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgechat.engine.request import ChatRequest, Finished, RequestStatus, TextDelta
from edgechat.errors import EdgechatError
from edgechat.server import responses
from edgechat.server.auth import BearerAuth
from edgechat.server.bridge import Generation
from edgechat.server.degrade import DegradeSwitch
from edgechat.server.errors import ApiError, from_engine_error, prompt_too_long
from edgechat.server.metrics import ServerMetrics
from edgechat.server.responses import ResponseIds, sse
from edgechat.server.schemas import ParsedRequest, decode_body, parse_chat, parse_completion
from edgechat.server.settings import ServerSettings

log = logging.getLogger("edgechat.server")


class _Served:
    """One engine and the names requests may call it by."""

    def __init__(self, engine, model_id: str | None):
        path = engine.model_info.path
        self.engine = engine
        self.id = model_id or path.stem
        # requests may also name the model by its file or by the name in its metadata
        self.names = {n.lower() for n in (self.id, path.stem, path.name, engine.model_name) if n}

    def card(self, created: int) -> dict:
        info, engine = self.engine.model_info, self.engine
        return {
            "id": self.id,
            "object": "model",
            "created": created,
            "owned_by": "edgechat",
            "meta": {
                "architecture": info.architecture,
                "quant": info.quant,
                "size_bytes": info.size_bytes,
                "n_ctx": engine.n_ctx,
                "template_mode": engine.template_mode,
            },
        }


class _Server:
    def __init__(self, settings: ServerSettings, engine, fallback=None):
        self.settings = settings
        self.engine = engine
        self.primary = _Served(engine, settings.model_id)
        #: the smaller model degraded requests go to, if any
        self.fallback = _Served(fallback, None) if fallback is not None else None
        self.metrics = ServerMetrics()
        self.degrade = DegradeSwitch(
            settings.degrade_queue_wait,
            settings.degrade_max_tokens,
            on_switch=lambda on: self.metrics.degrade_switches.inc() if on else None,
        )
        self.created = int(time.time())
        #: submitted and not finished: the degrade switch reads how long the queued ones wait
        self.in_flight: set[Generation] = set()

    # ---- bookkeeping -------------------------------------------------------------------------

    def on_finished(self, gen: Generation, finished: Finished) -> None:
        """Count a request's end (on the event loop, once per request)."""
        self.in_flight.discard(gen)
        if finished.reason in ("stop", "length"):
            outcome = "ok"
            self.degrade.observe(finished.metrics.queue_wait)
        elif finished.reason == "cancelled":
            outcome = "timeout" if gen.timed_out else "cancelled"
        else:
            outcome = "error"
            log.error("generation failed: %s", finished.error)
        self.metrics.observe_finished(finished.metrics, outcome)

    def oldest_queued_wait(self) -> float:
        now = time.monotonic()
        waits = [now - g.submitted for g in self.in_flight if g.handle.status is RequestStatus.WAITING]
        return max(waits, default=0.0)

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about what a queued request waits now."""
        return min(60, max(self.settings.retry_after, math.ceil(self.degrade.avg_wait)))

    def reject(self, error: ApiError) -> ApiError:
        self.metrics.requests.labels("rejected").inc()
        return error

    # ---- plain endpoints ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        stats = self.engine.stats()
        return JSONResponse({"status": "ok", "model": self.primary.id, **stats, "degraded": self.degrade.active})

    def served(self) -> list[_Served]:
        return [self.primary] + ([self.fallback] if self.fallback else [])

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [m.card(self.created) for m in self.served()]})

    async def get_model(self, request: Request) -> Response:
        return JSONResponse(self.find_model(request.path_params["model"]).card(self.created))

    async def metrics_endpoint(self, request: Request) -> Response:
        body = self.metrics.render(self.engine.stats(), self.degrade.active)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- generation --------------------------------------------------------------------------

    def find_model(self, name: str | None) -> _Served:
        # a missing or empty model means "whatever is loaded", as llama-server does
        if not name:
            return self.primary
        for served in self.served():
            if name.lower() in served.names:
                return served
        have = ", ".join(f"'{m.id}'" for m in self.served())
        raise ApiError(404, f"the model '{name}' does not exist here; this server has {have}", param="model", code="model_not_found")

    def route(self, served: _Served) -> _Served:
        """The model a request runs on: the one it names, or the fallback while degraded."""
        if served is self.primary and self.fallback is not None and self.degrade.active:
            self.metrics.fallback_requests.inc()
            return self.fallback
        return served

    async def read_body(self, request: Request) -> dict:
        limit = self.settings.max_body_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        return decode_body(b"".join(chunks))

    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        parsed = parse_chat(await self.read_body(request), self.settings.max_messages)
        return await self.generate(request, parsed, "chat", arrival)

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        parsed = parse_completion(await self.read_body(request))
        return await self.generate(request, parsed, "text", arrival)

    async def admit(self, engine, req: ChatRequest):
        """Build the prompt once, enforce --max-input-tokens and fit max_tokens to the room the
        prompt leaves; returns the built prompt for submit().

        The engine keeps going past a full context by shifting it, so an unbounded or huge
        max_tokens (10**9) must be cut to what the context holds, or the answer never ends.
        """
        n_ctx, limit = engine.n_ctx, self.settings.max_input_tokens
        # templating and tokenizing: keep them off the event loop
        prepared = await run_in_threadpool(engine.prepare, req)
        n = len(prepared.tokens)
        if limit is not None and n > limit:
            raise self.reject(prompt_too_long(n, limit, "the server's --max-input-tokens"))
        room = n_ctx - n
        if req.max_tokens is not None and req.max_tokens > room >= 1:
            req.max_tokens = room
        elif req.max_tokens is None and room >= n_ctx // 4:
            # with no max_tokens the engine keeps a quarter of the context for the answer
            # and refuses longer prompts itself (in submit)
            req.max_tokens = room
        req.max_tokens = self.degrade.cap(req.max_tokens)
        return prepared

    async def generate(self, request: Request, parsed: ParsedRequest, kind: str, arrival: float) -> Response:
        served = self.find_model(parsed.model)
        req = parsed.request
        waiting = sum(m.engine.stats()["waiting"] for m in self.served())
        self.degrade.on_admit(waiting, self.oldest_queued_wait())
        served = self.route(served)
        gen = Generation(asyncio.get_running_loop(), arrival + self.settings.request_timeout, self.on_finished)
        try:
            prepared = await self.admit(served.engine, req)
            handle = served.engine.submit(req, gen.on_event, prepared)
        except EdgechatError as exc:
            raise self.reject(from_engine_error(exc, self.retry_after())) from None
        gen.handle = handle
        if not gen.finished.done():
            self.in_flight.add(gen)
        ids = ResponseIds.new(kind, served.id)
        if parsed.stream:
            return StreamingResponse(
                self.stream(gen, parsed, kind, ids), media_type="text/event-stream", headers=responses.SSE_HEADERS
            )
        finished = await self.wait(request, gen)
        if finished is None:
            # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(responses.completion_body(finished, kind, ids))

    async def wait(self, request: Request, gen: Generation) -> Finished | None:
        """The Finished event, or None if the client disconnected first (its sequence is cancelled)."""
        disconnect = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait(
                {gen.finished, disconnect}, timeout=gen.remaining(), return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            # the server is shutting down under us: free the sequence
            gen.handle.cancel()
            raise
        finally:
            disconnect.cancel()
        if gen.finished.done():
            return _check_failed(gen.finished.result())
        if disconnect in done:
            gen.handle.cancel()
            return None
        gen.time_out()
        raise ApiError(
            504,
            f"the request did not finish within {self.settings.request_timeout:g} s and was cancelled",
            type="timeout",
            code="timeout",
        )

    async def stream(self, gen: Generation, parsed: ParsedRequest, kind: str, ids: ResponseIds) -> AsyncIterator[str]:
        finished: Finished | None = None
        try:
            if kind == "chat":
                yield sse(responses.chunk(kind, ids, None, None, role=True))
            while finished is None:
                try:
                    event = await asyncio.wait_for(gen.events.get(), gen.remaining())
                except asyncio.TimeoutError:
                    gen.time_out()
                    yield sse(ApiError(504, "the request timed out and was cancelled", type="timeout", code="timeout").body())
                    return
                # under load several tokens queue up between two writes: send them as one chunk
                text = []
                while True:
                    if isinstance(event, TextDelta):
                        text.append(event.text)
                    elif isinstance(event, Finished):
                        finished = event
                        break
                    if gen.events.empty():
                        break
                    event = gen.events.get_nowait()
                if any(text):
                    yield sse(responses.chunk(kind, ids, "".join(text), None))
            if finished.reason not in ("stop", "length"):
                message = finished.error or f"the generation ended: {finished.reason}"
                yield sse(ApiError(500, message, type="server_error", code=finished.reason).body())
                return
            yield sse(responses.chunk(kind, ids, None, finished.reason))
            if parsed.include_usage:
                yield sse(responses.usage_chunk(kind, ids, finished))
            yield sse("[DONE]")
        finally:
            if finished is None:
                # client disconnected (the task was cancelled) or timed out: free the sequence now
                gen.handle.cancel()


def _check_failed(finished: Finished) -> Finished:
    if finished.reason not in ("stop", "length"):
        raise ApiError(500, finished.error or f"the generation ended: {finished.reason}", type="server_error", code=finished.reason)
    return finished


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so only disconnect can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _api_error(request: Request, exc: ApiError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return ApiError(500, "internal server error", type="server_error").response()


def create_app(settings: ServerSettings, engine, fallback=None) -> Starlette:
    """The ASGI app serving `engine` (and, while degraded, `fallback`, a smaller model's engine).

    It does not own the engines: the caller closes them.
    """
    server = _Server(settings, engine, fallback)
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.get_model, methods=["GET"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(BearerAuth, api_key=settings.api_key)],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
    )
    app.state.server = server
    return app

