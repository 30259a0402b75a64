"""Several models in one process: each loaded when a request asks for it, within a memory
budget, and unloaded when idle.

The pool lives in the engine package, not the server's: it knows engines, the planner and
memory, nothing of HTTP, so the chat app and the degrade switch's fallback can use it too. The
server maps its names and aliases onto pool entries and its errors onto statuses.

Rules, all under one lock:
- what a model will cost is the planner's estimate (weights + KV + compute) made before loading;
- a load happens only where that fits beside what is loaded (`budget` bytes, else the memory
  the OS has available now); otherwise idle models leave, least recently used first; a model
  with requests (a lease held) never leaves; when that is not enough, NoRoomError says why;
- one load at a time; those who ask for a loading model wait for it; a failed load fails
  every request that waited on it with the same one-line ModelLoadError, and the entry stays
  unloaded (the next request tries again: the file may be fixed);
- a model whose last lease ended `keep_alive` seconds ago (per request, else the model's
  `idle_unload`) is unloaded by the pool's reaper thread. Closing an engine snapshots its
  conversations, and its prompt states where the prompt cache has disk (`prompt_cache_disk`),
  so a reload resumes from them.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import gc
import logging
import math
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgechat.errors import EdgechatError, ModelLoadError, NoRoomError, UsageError
from edgechat.models import planner

if TYPE_CHECKING:
    from edgechat.engine.core import Engine, EngineConfig
    from edgechat.models.ggufinfo import ModelInfo

log = logging.getLogger("edgechat.engine")

#: a request's keep_alive meaning "keep it loaded until something needs the room"
KEEP_FOREVER = math.inf


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(eq=False)
class PoolModel:
    """One model the pool may hold: how to load it, what it costs, who is using it."""

    name: str
    #: how to open it (engine.open_engine's config); None for an engine given already loaded
    config: EngineConfig | None
    #: its file's header (ModelInfo: path, architecture, size...), read without loading
    info: ModelInfo
    #: what the engine calls it (Engine.model_name)
    display_name: str
    #: the planner's estimate of what it holds once loaded (bytes)
    need: int
    #: context per sequence, and sequences
    n_ctx: int
    n_parallel: int
    #: seconds idle before it is unloaded (None: only when the room is needed)
    idle_unload: float | None = None
    engine: Engine | None = None
    state: ModelState = ModelState.UNLOADED
    #: leases held: requests submitted to it and not finished
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)
    #: when an idle model is unloaded (monotonic; None: not by the clock)
    unload_at: float | None = None
    #: how long its last load took (seconds)
    load_seconds: float | None = None
    loads: int = 0
    #: the last failed load's error, and which load it was
    error: str | None = None
    _failed_load: int = -1

    @property
    def pinned(self) -> bool:
        """Given loaded by the caller, who closes it: never unloaded by the pool."""
        return self.config is None

    def idle_seconds(self, now: float | None = None) -> float | None:
        if self.users or self.state is not ModelState.LOADED:
            return None
        return (now or time.monotonic()) - self.last_used


def plan_model(name: str | None, config, idle_unload: float | None = None) -> PoolModel:
    """The pool entry of an EngineConfig (named `name`, else after its file): its file read and
    its memory planned as the engine will plan it, nothing loaded (raises the resolver's or the
    planner's one-line errors)."""
    from edgechat.config import get_paths
    from edgechat.models import display_name, find_projector, resolve_model
    from edgechat.models.onnxinfo import read_info

    paths = config.paths or get_paths()
    path = resolve_model(config.model, paths)
    info = read_info(path)
    label = display_name(config.model, path)
    n_seq = config.n_parallel + config.hot_sessions
    projector = planner.projector_bytes(find_projector(config.mmproj, path, config.model, paths))
    plan = planner.choose_context(info, config.n_ctx, n_seq, config.kv_type, swa=config.swa_cache, label=label, projector=projector,
                                  flash_attn=config.flash_attn, cap=config.ctx_cap)
    return PoolModel(name or path.stem, config, info, label, plan.total, plan.n_ctx, config.n_parallel, idle_unload)


class ModelPool:
    """Models by name; `acquire` gives a loaded engine (loading it if need be) and holds it
    until `release`. Thread-safe; acquire blocks while a load is under way."""

    def __init__(self, budget: int | None = None, opener: Callable | None = None,
                 on_event: Callable[[str, PoolModel, float], None] | None = None, held_elsewhere: Callable[[], int] | None = None):
        #: bytes the loaded models may take together (None: what the OS has available)
        self.budget = budget
        #: bytes of the budget other models hold now (the speech models beside these)
        self.held_elsewhere = held_elsewhere or (lambda: 0)
        self._open = opener or _open_engine
        #: told of every "load", "unload" and "load_failed" (with the seconds it took), outside the lock
        self.on_event = on_event
        self.models: dict[str, PoolModel] = {}
        self._cond = threading.Condition()
        self._loading: PoolModel | None = None
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="edgechat-pool", daemon=True)

    # ---------------------------------------------------------------- setup
    def add(self, name: str | None, config, idle_unload: float | None = None) -> PoolModel:
        """A model to load on demand; its cost is planned now (its file must be readable)."""
        return self._add(plan_model(name, config, idle_unload))

    def add_loaded(self, name: str, engine) -> PoolModel:
        """An engine the caller opened and will close: always loaded, never unloaded here."""
        plan = getattr(engine, "plan", None)
        model = PoolModel(name, None, engine.model_info, engine.model_name, plan.total if plan else 0, engine.n_ctx,
                          engine.config.n_parallel, engine=engine, state=ModelState.LOADED)
        return self._add(model)

    def _add(self, model: PoolModel) -> PoolModel:
        if model.name in self.models:
            raise UsageError(f"two models are named '{model.name}'; serve each model once")
        self.models[model.name] = model
        if model.config is not None and self._reaper.ident is None:
            _prepare_process()
            self._reaper.start()  # only a pool that loads models has idle ones to unload
        return model

    # ---------------------------------------------------------------- leases
    def acquire(self, name: str, timeout: float | None = None):
        """The model's engine, loaded, with a lease on it (give it back with release): loads
        it first if need be, unloading idle models to make room. Raises NoRoomError (nothing
        can make room now), ModelLoadError (its load failed) or TimeoutError (a load under way
        took longer than `timeout`)."""
        model = self.models[name]
        deadline = None if timeout is None else time.monotonic() + timeout
        victims: list[PoolModel] = []
        with self._cond:
            waited_on = None
            while True:
                if self._closed:
                    raise EdgechatError("the server is shutting down")
                if model.state is ModelState.LOADED:
                    model.users += 1
                    model.last_used, model.unload_at = time.monotonic(), None
                    return model.engine
                if waited_on is not None and model._failed_load == waited_on:
                    raise ModelLoadError(model.error)
                if model.state is ModelState.UNLOADED and self._loading is None:
                    victims = self._make_room(model)
                    break
                if model.state is ModelState.LOADING:
                    waited_on = model.loads
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"'{name}' was still waiting for a load after {timeout:g} s")
                self._cond.wait(left)
            model.state, self._loading = ModelState.LOADING, model
            model.loads += 1
            for v in victims:
                v.state = ModelState.UNLOADING
        for v in victims:
            self._unload(v, "to make room for " + name)
        started = time.monotonic()
        try:
            engine = self._open(model.config)
        except Exception as exc:
            why = str(exc) if isinstance(exc, EdgechatError) else f"{type(exc).__name__}: {exc}"
            message = f"the model '{name}' could not be loaded: {why}"
            log.error("%s", message)
            with self._cond:
                model.state, self._loading = ModelState.UNLOADED, None
                model.error, model._failed_load = message, model.loads
                self._cond.notify_all()
            self._tell("load_failed", model, time.monotonic() - started)
            raise ModelLoadError(message) from None
        seconds = time.monotonic() - started
        with self._cond:
            closing = self._closed
            model.engine, self._loading = engine, None
            model.state = ModelState.UNLOADING if closing else ModelState.LOADED
            model.load_seconds, model.error = seconds, None
            model.users += 0 if closing else 1
            model.last_used, model.unload_at = time.monotonic(), None
            self._cond.notify_all()
        if closing:  # close() came while it loaded: nobody will give it back
            self._unload(model, "closing")
            raise EdgechatError("the server is shutting down")
        log.info("loaded %s in %.2f s", name, seconds)
        self._tell("load", model, seconds)
        return engine

    def try_acquire(self, name: str) -> bool:
        """A lease on the model if it is loaded now, without waiting (False: acquire it)."""
        model = self.models[name]
        with self._cond:
            if model.state is not ModelState.LOADED or self._closed or (model.engine is not None and model.engine.stopped):
                return False
            model.users += 1
            model.last_used, model.unload_at = time.monotonic(), None
            return True

    def release(self, name: str, keep_alive: float | None = None) -> None:
        """A lease ends. `keep_alive`: seconds the model stays loaded once idle (0: unload it
        now, KEEP_FOREVER: until the room is needed; None: the model's idle_unload). As in
        Ollama, the last request to finish sets the clock."""
        model = self.models[name]
        with self._cond:
            model.users -= 1
            now = model.last_used = time.monotonic()
            dead = model.engine is not None and model.engine.stopped is not None and not model.pinned
            if model.users == 0 and dead and model.state is ModelState.LOADED:
                # its thread died: unloaded now, so the next request loads it afresh (a restart)
                model.state = ModelState.UNLOADING
            elif model.users == 0:
                keep = model.idle_unload if keep_alive is None else keep_alive
                model.unload_at = None if keep is None or keep == KEEP_FOREVER else now + max(keep, 0.0)
                dead = False
            self._cond.notify_all()
        if dead and model.state is ModelState.UNLOADING and model.engine is not None:
            log.error("the engine of %s stopped (%s); it is loaded again for the next request", name, model.engine.stopped)
            self._unload(model, "its engine stopped")

    def unload(self, name: str) -> bool:
        """Unload an idle model now; False if it is busy, pinned or not loaded."""
        model = self.models[name]
        with self._cond:
            if model.state is not ModelState.LOADED or model.users or model.pinned:
                return False
            model.state = ModelState.UNLOADING
        self._unload(model, "asked")
        return True

    def resident(self) -> list[PoolModel]:
        with self._cond:
            return [m for m in self.models.values() if m.state is ModelState.LOADED]

    def close(self) -> None:
        """Unload every model the pool loaded (each snapshots its conversations first)."""
        with self._cond:
            self._closed = True
            going = [m for m in self.models.values() if m.state is ModelState.LOADED and not m.pinned]
            for m in going:
                m.state = ModelState.UNLOADING
            self._cond.notify_all()
        for m in going:
            self._unload(m, "closing")
        if self._reaper.is_alive():
            self._reaper.join(timeout=5)

    # ---------------------------------------------------------------- inside
    def _make_room(self, model: PoolModel) -> list[PoolModel]:
        """The idle models to unload (least recently used first) so `model` fits; raises
        NoRoomError when even unloading every idle one is not enough. Under the lock."""
        resident = [m for m in self.models.values() if m.state in (ModelState.LOADED, ModelState.LOADING) and m is not model]
        idle = sorted((m for m in resident if not m.users and not m.pinned), key=lambda m: m.last_used)
        victims: list[PoolModel] = []
        while not self._fits(model, [m for m in resident if m not in victims], victims):
            if not idle:
                raise NoRoomError(self._no_room(model, [m for m in resident if m not in victims]), retry_after=self._retry_after())
            victims.append(idle.pop(0))
        return victims

    def _fits(self, model: PoolModel, staying: list[PoolModel], leaving: list[PoolModel]) -> bool:
        if self.budget is not None:
            return sum(m.need for m in staying) + model.need + self.held_elsewhere() <= self.budget
        # the OS's count already holds the loaded models; those leaving give theirs back
        return model.need <= (planner.available_memory() + sum(m.need for m in leaving)) * planner.headroom()

    def _no_room(self, model: PoolModel, staying: list[PoolModel]) -> str:
        limit = f"the memory budget of {_mib(self.budget)}" if self.budget is not None else "the memory available"
        if not staying:
            return f"cannot load '{model.name}': it needs {_mib(model.need)}, more than {limit}; lower its context or parallel sequences"
        busy = ", ".join(f"'{m.name}' ({_mib(m.need)}, {'loading' if m.state is ModelState.LOADING else f'{m.users} running'})" for m in staying)
        return f"cannot load '{model.name}' ({_mib(model.need)}) within {limit}: {busy} cannot be unloaded while in use; retry shortly"

    def _retry_after(self) -> int:
        """Seconds to wait before retrying: about a load's time, at least one."""
        times = [m.load_seconds for m in self.models.values() if m.load_seconds]
        return max(1, math.ceil(max(times, default=1.0)))

    def _unload(self, model: PoolModel, why: str) -> None:
        """Close an engine marked UNLOADING (outside the lock: closing writes its snapshots)."""
        started = time.monotonic()
        engine, model.engine = model.engine, None
        try:
            if engine is not None:
                engine.close()
        except Exception:  # a failure to close still frees the entry: the memory is gone or lost
            log.exception("closing %s failed", model.name)
        del engine
        # before it reads as unloaded: the engine's objects hold each other (callbacks), so their
        # buffers go at a collection, and glibc keeps freed blocks until trimmed
        gc.collect()
        _trim_heap()
        with self._cond:
            model.state, model.unload_at = ModelState.UNLOADED, None
            self._cond.notify_all()
        log.info("unloaded %s (%s)", model.name, why)
        self._tell("unload", model, time.monotonic() - started)

    def _reap(self) -> None:
        """Unload models whose idle time ran out."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                due = [m for m in self.models.values() if m.state is ModelState.LOADED and not m.users and not m.pinned
                       and m.unload_at is not None and m.unload_at <= now]
                if not due:
                    wake = [m.unload_at for m in self.models.values() if m.unload_at is not None and m.state is ModelState.LOADED]
                    # an hour at most: a huge keep_alive must not overflow the lock's timeout
                    self._cond.wait(min(max(0.0, min(wake) - now) + 0.01, 3600.0) if wake else None)
                    continue
                for m in due:
                    m.state = ModelState.UNLOADING
                self._cond.release()
                try:
                    for m in due:
                        self._unload(m, "idle")
                finally:
                    self._cond.acquire()

    def _tell(self, event: str, model: PoolModel, seconds: float) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event, model, seconds)
            except Exception:
                log.exception("pool event listener failed")


def _open_engine(config):
    from edgechat.engine import open_engine

    return open_engine(config)


def _mib(n: int | None) -> str:
    return f"{(n or 0) / (1 << 20):.0f} MiB"


#: mallopt's M_TRIM_THRESHOLD (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
#: free memory at the top of a heap beyond this goes back to the OS as it is freed (glibc's default)
TRIM_THRESHOLD = 128 << 10


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, whose allocator needs telling to give memory back; None elsewhere (musl, Android's
    bionic, macOS: their allocators return freed memory themselves, and have no malloc_trim)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@functools.cache
def _prepare_process() -> None:
    """Once per process, before a pool loads its first model.

    glibc's trim threshold is fixed at its default: glibc raises it (up to 64 MiB) each time a
    large block is freed, as llama.cpp's buffers are at an unload, and malloc_trim never trims
    the top of a thread's own arena, so the heap the engine thread freed stayed resident (8 MiB
    for SmolLM2 in bench_lifecycle, more after later loads).

    llama.cpp's backend is initialised now, not at the first load: its process-wide tables
    (ggml's fp16 and activation tables, 0.5 MiB) serve every model, llama.cpp's and the ONNX
    engine's alike (whose tokenizer and sampler are llama.cpp's), and outlive them all.
    """
    from edgechat.engine.runners.llamacpp import ensure_backend

    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ensure_backend()


def _trim_heap() -> None:
    """Give freed heap back to the OS: glibc keeps freed small blocks in its arenas, so the
    process's RSS would not fall after an unload without this."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
