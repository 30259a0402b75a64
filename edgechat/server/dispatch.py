"""The dispatcher: the models a server offers and every request's way to one of them, whatever
API it came in on. A request names a model (`find_model`, routed to the fallback while degraded);
it takes a lease on that model's engine (loading it first if need be: waiting for the load, a 503
when no room can be made), gets what every API shares, for that model and on a copy of its own
(server/rules.py: the family's tool grammar, the reasoning split, max_tokens fitted: `admit`),
waits for its priority class's share (`prepare`, `submit`), becomes one engine.submit() per
choice, followed on the event loop through a bridge.Generation, and moves to the fallback model
when no first token comes in time (`start`), fitted afresh there. Its lease goes back when its
last answer ends. It knows no wire format: each API's module renders (server/streaming.py
carries the answer to it), and every refusal here is an ApiError that the API called answers in
its own shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.routing import Route

from edgechat.config import get_paths
from edgechat.engine.pool import ModelPool, ModelState, PoolModel
from edgechat.engine.prompt.prompt import Prepared
from edgechat.engine.speech.models import SpeechModels
from edgechat.engine.types.request import ChatRequest, Event, Finished, RequestStatus
from edgechat.errors import EdgechatError, ModelLoadError, NoRoomError
from edgechat.models import find_projector
from edgechat.models.ggufinfo import read_projector_info
from edgechat.params import SamplingParams
from edgechat.server.bridge import Generation, Lease, Started
from edgechat.server.degrade import DegradeSwitch
from edgechat.server.errors import ApiError, bad_request, from_engine_error, overloaded, prompt_too_long
from edgechat.server.fields import ParsedRequest, decode_body
from edgechat.server.memoryguard import MemoryGuard
from edgechat.server.metrics import ServerMetrics
from edgechat.server.priority import ClassFull, PriorityGate
from edgechat.server.rules import fit_max_tokens, for_model
from edgechat.server.settings import ServerSettings

log = logging.getLogger("edgechat.server")
#: the priority class of every request when no classes are configured
DEFAULT_CLASS = "default"


class Served:
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
        """The loaded engine (None while unloaded: read it under a lease, Dispatcher.lease)."""
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


class Dispatcher:
    """One app's models, admission, leases and failover (`create_app` makes one; every API's
    module holds it)."""

    def __init__(self, settings: ServerSettings, engine=None, fallback=None, pool: ModelPool | None = None,
                 speech: SpeechModels | None = None):
        self.settings = settings
        #: the speech models the audio endpoints run (audio_api.py), loaded on first use
        self.speech = speech if speech is not None else SpeechModels()
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
        self.primary = Served(models[0], settings.aliases)
        self.others = [Served(m) for m in models[1:]]
        #: the smaller model degraded requests go to, if any
        self.fallback = Served(fallback_model) if fallback_model is not None else None
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
        self.memory = MemoryGuard(settings.memory_floor, self.pool, on_pressure=self.degrade.memory)
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

    def opened(self, req: ChatRequest) -> None:
        """Count a request that got under way."""
        if req.tools is not None:
            self.metrics.tool_requests.inc()
        if req.grammar is not None:
            self.metrics.grammar_requests.inc()

    def reject(self, error: ApiError) -> ApiError:
        self.metrics.requests.labels("rejected").inc()
        self.metrics.rejections.labels(error.code or str(error.status)).inc()
        return error

    # ---- models ------------------------------------------------------------------------------

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


    def served(self) -> list[Served]:
        return [self.primary, *self.others] + ([self.fallback] if self.fallback else [])


    # ---- generation --------------------------------------------------------------------------

    def find_model(self, name: str | None) -> Served:
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

    def route(self, served: Served) -> Served:
        """The model a request runs on: the one it names, or the fallback while degraded."""
        if served is self.primary and self.fallback is not None and self.degrade.active:
            self.metrics.fallback_requests.inc()
            return self.fallback
        return served

    async def lease(self, served: Served, keep_alive: float | None = None, deadline: float | None = None) -> Lease:
        """A hold on the model's engine, loading it first if need be (one load at a time; the
        others wait for it); every refusal is an ApiError."""
        pool, name = self.pool, served.model.name
        if served.model.state is ModelState.LOADED and pool.try_acquire(name):
            return Lease(pool, name, keep_alive)
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
        return Lease(pool, name, keep_alive)

    @contextlib.asynccontextmanager
    async def using(self, served: Served, keep_alive: float | None = None):
        """The model loaded for the length of a block (count_tokens, embeddings)."""
        lease = await self.lease(served, keep_alive, time.monotonic() + self.settings.request_timeout)
        try:
            yield served.engine
        finally:
            lease.drop()

    async def count_prompt(self, parsed: ParsedRequest) -> int:
        """The prompt tokens a request would decode, as the model it names builds it (Anthropic's
        count_tokens, the OpenAI input_tokens routes); nothing is generated."""
        served = self.find_model(parsed.model)
        try:
            # templating and tokenizing: off the event loop
            async with self.using(served) as engine:
                return await run_in_threadpool(lambda: engine.count_tokens(self.request_for(served, parsed)))
        except EdgechatError as exc:
            raise from_engine_error(exc, self.retry_after()) from None

    async def read_body(self, request: Request) -> dict:
        limit = self.settings.max_body_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        return decode_body(b"".join(chunks))


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

    def failover_at(self, request: Request, arrival: float, served: Served) -> float | None:
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

    async def prepare(self, served: Served, parsed: ParsedRequest, priority: str):
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

    async def submit(self, served: Served, parsed: ParsedRequest, req: ChatRequest, prepared, ticket, arrival: float, priority: str,
                     until: float | None, lease: Lease):
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

    async def start(self, served: Served, parsed: ParsedRequest, ready: tuple, arrival: float, priority: str, failover_at: float | None,
                    lease: Lease) -> Started:
        """Submit the request `prepare` made `ready` and, with a failover time, wait for its
        first token, moving to the fallback model if none comes in time."""
        req, prepared, ticket = ready
        gens = await self.submit(served, parsed, req, prepared, ticket, arrival, priority, failover_at, lease)
        if failover_at is None:
            return Started(served, req, gens)
        try:
            first = gens is not None and await done_within(gens[0].first, max(0.0, failover_at - time.monotonic()))
        except asyncio.CancelledError:
            _cancel(gens)  # the client left while the primary had not answered yet
            raise
        if first:
            return Started(served, req, gens)
        # no first token in time: the fallback answers instead of the client timing out
        fallback = self.fallback
        assert fallback is not None, "failover_at gives a time only with a fallback"
        _cancel(gens or [])
        self.metrics.failovers.inc()
        log.warning("request failed over to %s after %.1f s without a first token", fallback.id, time.monotonic() - arrival)
        fallback_lease = await self.lease(fallback, parsed.keep_alive, arrival + self.settings.request_timeout)
        try:
            req, prepared, _ = await self.prepare(fallback, parsed, priority)
            return Started(fallback, req, await self.submit(fallback, parsed, req, prepared, None, arrival, priority, None, fallback_lease))
        finally:
            fallback_lease.drop()

    def request_for(self, served: Served, parsed: ParsedRequest) -> ChatRequest:
        """The translated request as `served` runs it (server/rules.py), a copy of its own."""
        return for_model(parsed.request, served.tool_family, self.settings)

    async def admit(self, served: Served, parsed: ParsedRequest):
        """Build the request for the model and its prompt once, enforce --max-input-tokens and
        fit max_tokens to the room the prompt leaves (and the degrade switch's cap); returns the
        request and the built prompt for submit()."""
        limit = self.settings.max_input_tokens
        # templating and tokenizing: keep them off the event loop
        req, prepared = await run_in_threadpool(lambda: _build(served, self.request_for(served, parsed), parsed.client_grammar))
        n = len(prepared.tokens)
        if limit is not None and n > limit:
            raise self.reject(prompt_too_long(n, limit, "the server's --max-input-tokens"))
        return dataclasses.replace(req, max_tokens=self.degrade.cap(fit_max_tokens(req.max_tokens, n, served.engine.n_ctx))), prepared

    async def launch(self, request: Request, parsed: ParsedRequest, arrival: float) -> asyncio.Future[Started]:
        """Route, admit and start a request, whatever API it came in on: the task that gives its
        Started. Every refusal before any waiting is raised here; the task raises the later ones
        (its class's share not coming in time, the engine's queue full)."""
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
        self.metrics.in_flight.labels(served.id).observe(1 + sum(g.model == served.id for g in self.in_flight))
        if not await self.memory.admit():
            raise self.reject(ApiError(503, "the server is short of memory and takes no new request until it has room again; retry shortly",
                                       type="server_error", code="memory_low", headers={"Retry-After": str(self.settings.retry_after)}))
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



class Api:
    """One API's routes on the app's dispatcher: each API module's class is one (server/app.py
    gathers their routes)."""

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher

    def routes(self) -> list[Route]:
        raise NotImplementedError

async def done_within(task: asyncio.Future, timeout: float | None) -> bool:
    """Whether `task` (or a future) is done within `timeout` seconds (None: once it is); it runs
    on if not, and is cancelled with the caller."""
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    return bool(done)


def _build(served: Served, req: ChatRequest, client_grammar: bool) -> tuple[ChatRequest, Prepared]:
    if client_grammar and not served.engine.grammar_parses(req.grammar):
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

