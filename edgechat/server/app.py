"""The OpenAI-compatible HTTP API on one Engine (and optionally a smaller fallback one), or on
a pool of models loaded when asked (engine/pool.py).

create_app(settings, engine) or create_app(settings, pool=pool) builds a Starlette app whose
state lives in one _Server object, so several apps can share a process, even an engine. Each
HTTP request names a model; it takes a lease on that model's engine (loading it first if need
be: waiting for the load, a 503 when no room can be made), becomes one engine.submit(),
followed on the event loop through a bridge.Generation, and gives the lease back when its
last answer ends. The engine does the batching; this layer routes, parses, admits, streams,
cancels on disconnect or timeout, and counts. Response bodies are built in responses.py, the
API key is checked in auth.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgechat.config import get_paths
from edgechat.engine.pool import ModelPool, ModelState, PoolModel
from edgechat.engine.prompt import Prepared
from edgechat.engine.request import (
    ChatRequest,
    Event,
    Finished,
    RequestStatus,
    SamplingParams,
    TextDelta,
    ToolCallEvent,
)
from edgechat.engine.tools import tool_grammar
from edgechat.errors import EdgechatError, InvalidFieldError, ModelLoadError, NoRoomError
from edgechat.models import find_projector
from edgechat.models.ggufinfo import read_projector_info
from edgechat.server import anthropic_api, embeddings_api, llamacpp_api, ollama_api, openai_responses_api, responses
from edgechat.server.auth import BearerAuth
from edgechat.server.bridge import Generation, abandon
from edgechat.server.cors import Cors
from edgechat.server.degrade import DegradeSwitch
from edgechat.server.errors import ApiError, bad_request, field_error, from_engine_error, overloaded, prompt_too_long
from edgechat.server.images import ImageReader
from edgechat.server.keepalive import keep_alive_seconds
from edgechat.server.metrics import ServerMetrics
from edgechat.server.priority import ClassFull, PriorityGate
from edgechat.server.responses import KEEPALIVE, ResponseIds, sse
from edgechat.server.schemas import ParsedRequest, decode_body, parse_chat, parse_completion
from edgechat.server.settings import ServerSettings

log = logging.getLogger("edgechat.server")
#: an SSE comment: clients ignore it, connections with idle timeouts stay open
#: the priority class of every request when no classes are configured
DEFAULT_CLASS = "default"


class _Served:
    """One model this server offers, loaded or not (its pool entry), and the names requests may
    call it by."""

    def __init__(self, model: PoolModel, aliases: tuple[str, ...] = ()):
        path = model.info.path
        self.model = model
        self.id = model.name
        self.aliases = aliases
        # requests may also name the model by its file or by the name in its metadata
        self.names = {n.lower() for n in (self.id, path.stem, path.name, model.display_name, *aliases) if n}
        #: what a request's sampling starts from (its file's recommended settings): known unloaded
        self.default_sampling = SamplingParams(**model.info.sampling)

    @property
    def engine(self):
        """The loaded engine (None while unloaded: read it under a lease, _Server.lease)."""
        return self.model.engine

    @property
    def modalities(self) -> tuple[str, ...]:
        """What it reads besides text ("vision", ...): its projector's, loaded or not (then the
        projector its config names or its file has beside it, without loading it)."""
        if self.engine is not None:
            return self.engine.modalities
        config = self.model.config
        try:
            path = find_projector(config.mmproj, self.model.info.path, config.model, config.paths) if config else None
            return read_projector_info(path).modalities if path else ()
        except EdgechatError:
            return ()  # a projector file gone since the server started: its load will say so

    @property
    def tool_family(self):
        """The tool-call syntax its template writes (the generic one where it takes no tools)."""
        return self.engine.format.tool_family

    def request(self, parsed: ParsedRequest) -> ChatRequest:
        """The request for this model: with tools and a template that takes them, the grammar is
        its syntax (the engine's prompt builder renders tools, calls and results through that
        template, message by message)."""
        req, family = parsed.request, self.tool_family
        if parsed.tools is None or not family.native:
            return req
        return dataclasses.replace(req, grammar=tool_grammar(parsed.tools, family))

    def card(self, created: int, name: str | None = None) -> dict:
        m, engine = self.model, self.engine
        info = m.info
        idle = m.idle_seconds()
        return {
            "id": name or self.id,
            "object": "model",
            "created": created,
            "owned_by": "edgechat",
            "meta": {
                "architecture": info.architecture,
                "quant": info.quant,
                "size_bytes": info.size_bytes,
                "n_ctx": engine.n_ctx if engine is not None else m.n_ctx,
                "n_parallel": m.n_parallel,
                "template_mode": engine.template_mode if engine is not None else None,
                # edgechat's model lifecycle: loaded or not, what it takes (the planner's count:
                # weights, KV cache, compute), requests running on it, seconds idle
                "state": m.state.value,
                "memory_bytes": m.need,
                "running": m.users,
                "idle_seconds": None if idle is None else round(idle, 1),
                "unloads_in": None if m.unload_at is None else round(max(0.0, m.unload_at - time.monotonic()), 1),
                "load_seconds": m.load_seconds,
                "path": str(info.path),
                # what it reads besides text: ["vision"] with an image projector
                "modalities": list(self.modalities),
            },
        }


class _Lease:
    """A request's hold on its model: taken before it is built, given back when its last
    choice ends (or it fails before any is submitted), so the pool never unloads it under them."""

    def __init__(self, pool: ModelPool, name: str, keep_alive: float | None):
        self.pool, self.name, self.keep_alive = pool, name, keep_alive
        self.count = 1  # the launch's own, dropped once its choices are submitted (or not)

    def hold(self) -> None:
        self.count += 1

    def drop(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.pool.release(self.name, self.keep_alive)


class _Server:
    def __init__(self, settings: ServerSettings, engine=None, fallback=None, pool: ModelPool | None = None):
        self.settings = settings
        #: every model served: an engine given is a pool entry that is never unloaded
        self.pool = pool if pool is not None else ModelPool()
        if engine is not None:
            self.pool.add_loaded(settings.model_id or engine.model_info.path.stem, engine)
        fallback_model: PoolModel | None
        if isinstance(fallback, str):  # a pool model: loaded when degraded requests first need it
            fallback_model = self.pool.models[fallback]
        else:
            fallback_model = self.pool.add_loaded(fallback.model_info.path.stem, fallback) if fallback is not None else None
        models = [m for m in self.pool.models.values() if m is not fallback_model]
        if not models:
            raise ValueError("create_app needs an engine or a pool with a model")
        #: the first model: what a request naming none gets
        self.primary = _Served(models[0], settings.aliases)
        self.others = [_Served(m) for m in models[1:]]
        #: the smaller model degraded requests go to, if any
        self.fallback = _Served(fallback_model) if fallback_model is not None else None
        first = models[0].config
        self.paths = engine.paths if engine is not None else (first.paths if first is not None else None) or get_paths()
        self.metrics = ServerMetrics()
        self.pool.on_event = self.metrics.observe_pool
        #: threads that wait for a model's load (one loads; the others wait for it)
        self._loads = ThreadPoolExecutor(max_workers=32, thread_name_prefix="edgechat-load")
        #: admission by priority class to the primary model (None: one queue, arrival order)
        self.gate = PriorityGate(settings.priority_classes, self.primary.model.n_parallel) if settings.priority_classes else None
        self.classes = [c.name for c in settings.priority_classes] or [DEFAULT_CLASS]
        for served in self.served():
            self.metrics.add_model(served.id, self.classes)
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
        if gen.lease is not None:
            gen.lease.drop()
        if gen.ticket is not None:
            assert self.gate is not None, "tickets come from the gate"
            self.gate.release(gen.ticket)
        if finished.reason in ("stop", "length"):
            outcome = "ok"
            self.degrade.observe(finished.metrics.queue_wait)
        elif finished.reason == "cancelled":
            outcome = "timeout" if gen.timed_out else "cancelled"
        else:
            outcome = "error"
            log.error("generation failed: %s", finished.error)
        self.metrics.observe_finished(finished.metrics, outcome, gen.model, gen.priority)

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

    def defaults_for(self, name) -> SamplingParams:
        """The sampling defaults of the model a body names (the primary's for any other name:
        routing, and its 404, come after parsing)."""
        for served in self.served():
            if isinstance(name, str) and name.lower() in served.names:
                return served.default_sampling
        return self.primary.default_sampling

    def stats(self) -> dict:
        """The loaded engines' counts, added up (zeros while none is loaded)."""
        total: dict = dict.fromkeys(("running", "waiting", "kv_used", "kv_cached", "kv_total"), 0)
        for served in self.served():
            if (engine := served.engine) is not None:
                for key, value in engine.stats().items():
                    total[key] = total.get(key, 0) + value
        return total

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.primary.id, **self.stats(), "degraded": self.degrade.active})

    def served(self) -> list[_Served]:
        return [self.primary, *self.others] + ([self.fallback] if self.fallback else [])

    async def list_models(self, request: Request) -> Response:
        cards = [m.card(self.created, name) for m in self.served() for name in (m.id, *m.aliases)]
        return JSONResponse({"object": "list", "data": cards})

    async def get_model(self, request: Request) -> Response:
        return JSONResponse(self.find_model(request.path_params["model"]).card(self.created))

    async def metrics_endpoint(self, request: Request) -> Response:
        body = self.metrics.render(self.stats(), self.degrade.active, self.gate.snapshot() if self.gate else {}, self.pool.resident())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- generation --------------------------------------------------------------------------

    def find_model(self, name: str | None) -> _Served:
        # a missing or empty model means "whatever is loaded", as llama-server does
        if not name:
            return self.primary
        for served in self.served():
            if name.lower() in served.names:
                return served
        if self.settings.any_model_name:
            return self.primary
        have = ", ".join(f"'{m.id}'" for m in self.served())
        raise ApiError(404, f"the model '{name}' does not exist here; this server has {have}", param="model", code="model_not_found")

    def route(self, served: _Served) -> _Served:
        """The model a request runs on: the one it names, or the fallback while degraded."""
        if served is self.primary and self.fallback is not None and self.degrade.active:
            self.metrics.fallback_requests.inc()
            return self.fallback
        return served

    async def lease(self, served: _Served, keep_alive: float | None = None, deadline: float | None = None) -> _Lease:
        """A hold on the model's engine, loading it first if need be (one load at a time; the
        others wait for it); every refusal is an ApiError."""
        pool, name = self.pool, served.model.name
        if served.model.state is ModelState.LOADED and pool.try_acquire(name):
            return _Lease(pool, name, keep_alive)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        waiting = asyncio.get_running_loop().run_in_executor(self._loads, pool.acquire, name, timeout)
        try:
            await asyncio.shield(waiting)
        except asyncio.CancelledError:
            # the client left while the model loaded: its lease goes back once it is had
            def give_back(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    pool.release(name)

            waiting.add_done_callback(give_back)
            raise
        except NoRoomError as exc:
            raise self.reject(ApiError(503, str(exc), type="server_error", code="model_memory_full",
                                       headers={"Retry-After": str(exc.retry_after)})) from None
        except ModelLoadError as exc:
            raise self.reject(ApiError(500, str(exc), type="server_error", code="model_load_failed")) from None
        except TimeoutError as exc:
            raise self.reject(ApiError(504, str(exc), type="timeout", code="timeout")) from None
        except EdgechatError as exc:
            raise self.reject(ApiError(503, str(exc), type="server_error", code="engine_stopped")) from None
        return _Lease(pool, name, keep_alive)

    @contextlib.asynccontextmanager
    async def using(self, served: _Served, keep_alive: float | None = None):
        """The model loaded for the length of a block (count_tokens, embeddings)."""
        lease = await self.lease(served, keep_alive, time.monotonic() + self.settings.request_timeout)
        try:
            yield served.engine
        finally:
            lease.drop()

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
        body = await self.read_body(request)
        parsed = parse_chat(body, self.settings.max_messages, self.defaults_for(body.get("model")), self.settings.reasoning_budget,
                            ImageReader(self.settings))
        parsed.request.split_reasoning = self.settings.reasoning_format != "none"
        parsed.keep_alive = keep_alive_seconds(body.get("keep_alive"))
        return await self.generate(request, parsed, "chat", arrival)

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.read_body(request)
        parsed = parse_completion(body, self.defaults_for(body.get("model")))
        parsed.keep_alive = keep_alive_seconds(body.get("keep_alive"))
        return await self.generate(request, parsed, "text", arrival)

    def priority_of(self, request: Request) -> str:
        """The request's class: its API key's, else the one X-Priority names, else the default."""
        if self.gate is None:
            return DEFAULT_CLASS
        name = getattr(request.state, "key_class", None) or request.headers.get("x-priority")
        if name is None:
            return self.settings.default_class or self.classes[0]
        if name not in self.gate:
            have = ", ".join(self.classes)
            raise self.reject(bad_request(f"X-Priority names the class {name!r}; this server has {have}", param="X-Priority", code="invalid_value"))
        return name

    def failover_at(self, request: Request, arrival: float, served: _Served) -> float | None:
        """When a request without a first token moves to the fallback model (None: never)."""
        after = self.settings.failover_after
        header = request.headers.get("x-failover-after")
        if header is not None:
            try:
                after = float(header)
            except ValueError:
                after = -1.0
            if not 0 <= after < math.inf:
                raise self.reject(bad_request(f"X-Failover-After must be a number of seconds, got {header[:40]!r}", param="X-Failover-After"))
            if self.fallback is None:
                raise self.reject(bad_request("X-Failover-After needs a fallback model (serve --fallback-model)", param="X-Failover-After"))
        if after is None or self.fallback is None or served is not self.primary:
            return None
        return arrival + after

    async def prepare(self, served: _Served, parsed: ParsedRequest, priority: str):
        """Build and fit the request for `served` and take its place in the priority class's
        share or queue: (request, built prompt, ticket or None). Every refusal comes from here,
        before any waiting, so it is an HTTP status even for a stream."""
        try:
            req, prepared = await self.admit(served, parsed)
        except EdgechatError as exc:
            raise self.reject(from_engine_error(exc, self.retry_after())) from None
        if self.gate is None or served is not self.primary:
            return req, prepared, None
        try:
            return req, prepared, self.gate.reserve(priority, parsed.n)
        except ClassFull as full:
            raise self.reject(overloaded(full.retry_after)) from None

    async def submit(self, served: _Served, parsed: ParsedRequest, req: ChatRequest, prepared, ticket, arrival: float, priority: str,
                     until: float | None, lease: _Lease):
        """Wait for the class's share (if queued) and submit every choice: their Generations, or
        None if the share did not come free before `until` (the failover's time)."""
        gate = self.gate
        if ticket is not None:
            assert gate is not None, "tickets come from the gate"
            deadline = until if until is not None else arrival + self.settings.request_timeout
            try:
                await asyncio.wait_for(asyncio.shield(ticket.admitted), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                gate.release_all(ticket)
                if until is not None:
                    return None
                raise ApiError(504, f"the request waited {self.settings.request_timeout:g} s for its class's share and was dropped", type="timeout", code="timeout") from None
            except asyncio.CancelledError:
                gate.release_all(ticket)
                raise
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        gens: list[Generation] = []
        try:
            for i in range(parsed.n):
                gen = Generation(loop, arrival + self.settings.request_timeout, self.on_finished, i, events)
                gen.model, gen.priority, gen.ticket, gen.lease = served.id, priority, ticket, lease
                gen.prompt_tokens = len(prepared.tokens)
                gen.handle = served.engine.submit(_choice_request(req, i, gens), gen.on_event, prepared)
                lease.hold()  # given back in on_finished
                gens.append(gen)
                if not gen.finished.done():
                    self.in_flight.add(gen)
        except EdgechatError as exc:
            for gen in gens:  # the choices already queued go too: the answer is all n or none
                gen.handle.cancel()
            if ticket is not None:
                assert gate is not None, "tickets come from the gate"
                gate.release(ticket, parsed.n - len(gens))  # the submitted ones give theirs back as they end
            raise self.reject(from_engine_error(exc, self.retry_after())) from None
        return gens

    async def start(self, served: _Served, parsed: ParsedRequest, ready: tuple, arrival: float, priority: str, failover_at: float | None,
                    lease: _Lease):
        """Submit the request `prepare` made `ready` and, with a failover time, wait for its
        first token, moving to the fallback model if none comes in time: (the model answering,
        its request, its Generations)."""
        req, prepared, ticket = ready
        gens = await self.submit(served, parsed, req, prepared, ticket, arrival, priority, failover_at, lease)
        if failover_at is None:
            return served, req, gens
        try:
            first = gens is not None and await _done_within(gens[0].first, max(0.0, failover_at - time.monotonic()))
        except asyncio.CancelledError:
            _cancel(gens)  # the client left while the primary had not answered yet
            raise
        if first:
            return served, req, gens
        # no first token in time: the fallback answers instead of the client timing out
        fallback = self.fallback
        assert fallback is not None, "failover_at gives a time only with a fallback"
        _cancel(gens or [])
        self.metrics.failovers.inc()
        log.warning("request failed over to %s after %.1f s without a first token", fallback.id, time.monotonic() - arrival)
        fallback_lease = await self.lease(fallback, parsed.keep_alive, arrival + self.settings.request_timeout)
        try:
            req, prepared, _ = await self.prepare(fallback, parsed, priority)
            return fallback, req, await self.submit(fallback, parsed, req, prepared, None, arrival, priority, None, fallback_lease)
        finally:
            fallback_lease.drop()

    async def admit(self, served: _Served, parsed: ParsedRequest):
        """Build the request for the model and its prompt once, enforce --max-input-tokens and
        fit max_tokens to the room the prompt leaves; returns the request and the built prompt
        for submit().

        The engine keeps going past a full context by shifting it, so an unbounded or huge
        max_tokens (10**9) must be cut to what the context holds, or the answer never ends.
        """
        engine = served.engine
        n_ctx, limit = engine.n_ctx, self.settings.max_input_tokens
        # templating and tokenizing: keep them off the event loop
        req, prepared = await run_in_threadpool(_build, served, parsed)
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
        return req, prepared

    async def launch(self, request: Request, parsed: ParsedRequest, arrival: float) -> asyncio.Future:
        """Route, admit and start a request, whatever API it came in on: the task that gives
        (the model answering, its request, its Generations). Every refusal is raised here."""
        served = self.find_model(parsed.model)
        priority = self.priority_of(request)
        self.degrade.on_admit(self.stats().get("waiting", 0), self.oldest_queued_wait())
        served = self.route(served)
        parallel = served.model.n_parallel
        if self.gate is not None and served is self.primary:
            parallel = min(parallel, self.gate.share(priority))
        if parsed.n > parallel:
            raise self.reject(
                bad_request(f"'n' is {parsed.n}, more than the {parallel} answers this server generates at once for this request", param="n", code="invalid_value")
            )
        failover_at = self.failover_at(request, arrival, served)
        lease = await self.lease(served, parsed.keep_alive, arrival + self.settings.request_timeout)
        try:
            ready = await self.prepare(served, parsed, priority)
        except BaseException:
            lease.drop()
            raise
        started = asyncio.ensure_future(self.start(served, parsed, ready, arrival, priority, failover_at, lease))
        # a done callback, not a finally: it runs even for a task cancelled before it began
        started.add_done_callback(lambda _: lease.drop())
        return started

    async def generate(self, request: Request, parsed: ParsedRequest, kind: str, arrival: float) -> Response:
        start = await self.launch(request, parsed, arrival)
        if parsed.stream and not await _done_within(start, self.settings.keepalive_s):
            # still waiting (its class's share, the failover's first token): the stream opens
            # now with keep-alive comments, so clients and proxies with read timeouts hold on
            return StreamingResponse(self.stream_once_started(start, parsed, kind), media_type="text/event-stream", headers=responses.SSE_HEADERS)
        served, req, gens = await start
        ids = self.opened(served, parsed, req, kind)
        if parsed.stream:
            return StreamingResponse(
                self.stream(gens, parsed, kind, ids, served), media_type="text/event-stream", headers=responses.SSE_HEADERS
            )
        finished = await self.wait(request, gens)
        if finished is None:
            # the client left; nobody reads this
            return Response(status_code=499)
        choices = [self.choice(f, parsed, served) for f in finished]
        return JSONResponse(responses.completion_body(choices, kind, ids))

    def opened(self, served: _Served, parsed: ParsedRequest, req: ChatRequest, kind: str) -> ResponseIds:
        """Count a request that got under way; the ids its response carries."""
        if parsed.tools is not None:
            self.metrics.tool_requests.inc()
        if req.grammar is not None:
            self.metrics.grammar_requests.inc()
        return ResponseIds.new(kind, served.id)

    def choice(self, finished: Finished, parsed: ParsedRequest, served: _Served) -> responses.Choice:
        if parsed.tools is None:
            return responses.Choice(finished, finished.text)
        self.metrics.tool_calls.inc(len(finished.tool_calls))
        return responses.Choice(finished, finished.text, finished.tool_calls)

    async def wait(self, request: Request, gens: list[Generation]) -> list[Finished] | None:
        """Every choice's Finished event, or None if the client disconnected first (their
        sequences are cancelled)."""
        disconnect = asyncio.ensure_future(_disconnected(request))
        # asyncio.wait, not gather: cancelling a gather would cancel the futures the bridge
        # still has to complete (and count) when each Finished arrives
        pending: set = {g.finished for g in gens}
        try:
            while pending:
                done, pending = await asyncio.wait(pending | {disconnect}, timeout=gens[0].remaining(), return_when=asyncio.FIRST_COMPLETED)
                if disconnect in done:
                    _cancel(gens)
                    return None
                pending.discard(disconnect)
                if not done:
                    break
        except asyncio.CancelledError:
            # the server is shutting down under us: free the sequences
            _cancel(gens)
            raise
        finally:
            disconnect.cancel()
        if not pending:
            return [_check_failed(g.finished.result()) for g in gens]
        for gen in gens:
            gen.time_out()
        raise ApiError(
            504,
            f"the request did not finish within {self.settings.request_timeout:g} s and was cancelled",
            type="timeout",
            code="timeout",
        )

    async def stream_once_started(self, start: asyncio.Future, parsed: ParsedRequest, kind: str) -> AsyncIterator[str]:
        """Keep-alive comments until the request is under way, then its answer; a refusal
        after the response opened comes as an SSE error, as a timeout mid-stream does."""
        try:
            yield KEEPALIVE
            while not await _done_within(start, self.settings.keepalive_s):
                yield KEEPALIVE
        except BaseException:
            abandon(start)
            raise
        try:
            served, req, gens = start.result()
        except ApiError as exc:
            yield sse(exc.body())
            return
        async for out in self.stream(gens, parsed, kind, self.opened(served, parsed, req, kind), served):
            yield out

    async def stream(self, gens: list[Generation], parsed: ParsedRequest, kind: str, ids: ResponseIds, served: _Served) -> AsyncIterator[str]:
        events = gens[0].events
        choices = [_StreamedChoice() for _ in gens]
        try:
            # the role chunk waits for the first event: until then only keep-alive comments
            # go out, so a client sees its first data when the answer starts
            role_sent = kind != "chat"
            while not all(c.finished for c in choices):
                remaining = gens[0].remaining()
                try:
                    event = await asyncio.wait_for(events.get(), min(remaining, self.settings.keepalive_s))
                except asyncio.TimeoutError:
                    if remaining > self.settings.keepalive_s:
                        yield KEEPALIVE
                        continue
                    for gen in gens:
                        gen.time_out()
                    yield sse(ApiError(504, "the request timed out and was cancelled", type="timeout", code="timeout").body())
                    return
                if not role_sent:
                    role_sent = True
                    for i in range(len(gens)):
                        yield sse(responses.chunk(kind, ids, None, None, role=True, index=i))
                # under load several tokens queue up between two writes: send them as one chunk
                texts: dict[int, list[TextDelta | ToolCallEvent]] = {}
                while True:
                    i, ev = event
                    if isinstance(ev, (TextDelta, ToolCallEvent)):
                        texts.setdefault(i, []).append(ev)
                    elif isinstance(ev, Finished):
                        choices[i].finished = ev
                    if events.empty():
                        break
                    event = events.get_nowait()
                for i, deltas in texts.items():
                    for out in self.stream_text(kind, ids, i, choices[i], deltas):
                        yield out
                for i, c in enumerate(choices):
                    if c.finished is None or c.done:
                        continue
                    c.done = True
                    if c.finished.reason not in ("stop", "length"):
                        message = c.finished.error or f"the generation ended: {c.finished.reason}"
                        yield sse(ApiError(500, message, type="server_error", code=c.finished.reason).body())
                        return
                    for out in self.stream_end(kind, ids, i, c, c.finished):
                        yield out
            if parsed.include_usage:
                # the loop above ends once every choice has finished
                yield sse(responses.usage_chunk(kind, ids, [c.finished for c in choices if c.finished is not None]))
            yield sse("[DONE]")
        finally:
            # client disconnected (the task was cancelled), timed out or one choice failed: free the sequences now
            _cancel([g for g, c in zip(gens, choices, strict=True) if c.finished is None])

    def stream_text(self, kind: str, ids: ResponseIds, index: int, c: _StreamedChoice, events: list[TextDelta | ToolCallEvent]):
        calls = [e.call for e in events if isinstance(e, ToolCallEvent)]
        deltas = [e for e in events if isinstance(e, TextDelta)]
        thought = "".join(d.text for d in deltas if d.reasoning)
        if thought and kind == "chat":
            # thoughts before the answer's text: tool calls and stop strings never see them
            yield sse(responses.chunk(kind, ids, None, None, index=index, reasoning=thought))
        deltas = [d for d in deltas if not d.reasoning]
        if deltas:
            text = "".join(d.text for d in deltas)
            entries = [e for d in deltas for e in d.logprobs or ()] if deltas[0].logprobs is not None else None
            logprobs = responses.logprobs_body(kind, entries, c.offset)
            c.offset += len(text)
            if text or logprobs is not None and entries:
                yield sse(responses.chunk(kind, ids, text if text else None, None, index=index, logprobs=logprobs))
        for call in calls:
            self.metrics.tool_calls.inc()
            for part in responses.tool_call_deltas(len(c.calls), call):
                yield sse(responses.chunk(kind, ids, None, None, index=index, tool_calls=part))
            c.calls.append(call)

    def stream_end(self, kind: str, ids: ResponseIds, index: int, c: _StreamedChoice, finished: Finished):
        reason = responses.Choice(finished, "", c.calls).finish_reason
        yield sse(responses.chunk(kind, ids, None, reason, index=index))


@dataclasses.dataclass
class _StreamedChoice:
    finished: Finished | None = None
    done: bool = False  # its last chunk is sent
    offset: int = 0  # text sent so far (the legacy logprobs' text_offset)
    calls: list = dataclasses.field(default_factory=list)


async def _done_within(task: asyncio.Future, timeout: float) -> bool:
    """Whether `task` (or a future) is done within `timeout` seconds; it runs on if not, and
    is cancelled with the caller."""
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    return bool(done)


def _build(served: _Served, parsed: ParsedRequest) -> tuple[ChatRequest, Prepared]:
    req = served.request(parsed)
    if parsed.client_grammar and not served.engine.grammar_parses(req.grammar):
        raise bad_request("'grammar' is not a GBNF grammar llama.cpp can parse (a 'root' rule, every rule it names defined); fix it",
                          param="grammar", code="invalid_grammar")
    return req, served.engine.prepare(req)


def _choice_request(req: ChatRequest, index: int, gens: list[Generation]) -> ChatRequest:
    """Choice `index` of n: the first as asked; the others share its prompt's cells and, with a
    seed, take the next seeds (the same seed would give the same answer n times)."""
    if index == 0:
        return req
    seed = req.sampling.seed
    sampling = dataclasses.replace(req.sampling, seed=None if seed is None else (seed + index) & 0xFFFFFFFF)
    return dataclasses.replace(req, sampling=sampling, prompt_shared_with=gens[0].handle)


def _cancel(gens: list[Generation]) -> None:
    for gen in gens:
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


def create_app(settings: ServerSettings, engine=None, fallback=None, pool: ModelPool | None = None) -> Starlette:
    """The ASGI app serving `engine` (and, while degraded, `fallback`: a smaller model's engine,
    or the name of one in the pool), and every model of `pool` (loaded when a request names one,
    unloaded when idle).

    It owns neither: the caller closes the engines and the pool.
    """
    server = _Server(settings, engine, fallback, pool)
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.get_model, methods=["GET"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
        # llama-server's unprefixed OpenAI routes, which its own front ends call
        Route("/models", server.list_models, methods=["GET"]),
        Route("/chat/completions", server.chat, methods=["POST"]),
        Route("/completions", server.completions, methods=["POST"]),
        *ollama_api.OllamaApi(server).routes(),
        *llamacpp_api.LlamaCppApi(server).routes(),
        *anthropic_api.MessagesApi(server).routes(),
        *openai_responses_api.ResponsesApi(server).routes(),
        *embeddings_api.EmbeddingsApi(server).routes(),
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
    app.state.server = server
    return app

