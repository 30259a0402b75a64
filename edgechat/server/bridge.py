"""The engine-to-asyncio bridge: one submitted request as the event loop sees it.

The engine calls back on its own thread; one `LoopWaker` per event loop carries every stream's
events into it (a stream's first event and its end at once, the tokens between on the loop's own
timer), where a handler awaits `finished` or reads them with `batch()`. A request's `Lease` (its
hold on its model) and `Started` (what the dispatcher's launch gives) live here, beside the
Generation that carries them, so the dispatcher and every API import them from below.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from edgechat.engine.pool import ModelPool
from edgechat.engine.types.request import (
    ChatRequest,
    Event,
    Finished,
    RequestHandle,
    TextDelta,
    TokenLogprob,
    ToolCall,
    ToolCallEvent,
)
from edgechat.server.priority import Ticket

#: while streams run, the event loop takes their events this often, on its own timer: 20 updates
#: a second read as smooth text, and on 2 cores every chunk the loop streams is CPU taken from
#: llama.cpp's threads (at 25 ms, warm prompt-cache passes ran 5-8% slower than at 50; the chat
#: app redraws at most every 150 ms for the same reason)
STREAM_FLUSH_S = 0.05


class LoopWaker:
    """Carries every stream's events from the engine thread to the event loop. The engine thread
    wakes the loop only for a stream's first event (the time to first token) and its end; the
    tokens in between wait for the loop's own timer, every STREAM_FLUSH_S while any stream runs.

    A wake-up from the engine thread (call_soon_threadsafe writes to the loop's socket, which
    releases the GIL) hands the GIL to the loop's thread, which then streams every pending
    token before the engine thread gets it back: traced in the server on 2 cores, that made
    one token's hand-over take 0.8 ms at p90, 3% of the engine's time. The loop's timer
    instead fires whenever it falls, and the engine thread spends 95% of its time in
    llama_decode, without the GIL."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: dict[Generation, list[Event]] = {}  # in the order they first had one
        self._scheduled = False  # a wake-up by the engine thread is on its way
        self._live: set[Generation] = set()  # streams that started and have not ended (loop thread)
        self._timer: asyncio.TimerHandle | None = None

    def post(self, gen: Generation, event: Event, urgent: bool) -> None:
        """Called on the engine thread."""
        with self._lock:
            self._pending.setdefault(gen, []).append(event)
            if self._scheduled or not urgent:
                return  # the wake-up on its way, or the loop's timer, takes it
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:
            # the loop is closed: the server is shutting down and nobody is listening
            pass

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, {}, False
        for gen, events in pending.items():
            self._live.add(gen)
            for event in events:
                gen._deliver(event)
                if isinstance(event, Finished):
                    self._live.discard(gen)
        if self._live and self._timer is None:
            self._timer = self._loop.call_later(STREAM_FLUSH_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._flush()


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = weakref.WeakKeyDictionary()


def waker(loop: asyncio.AbstractEventLoop) -> LoopWaker:
    """The loop's waker (made on the loop's thread, where Generations are)."""
    if loop not in _wakers:
        _wakers[loop] = LoopWaker(loop)
    return _wakers[loop]


class Generation:
    """One request's events on the event loop; `on_finished` runs there exactly once, with the
    Finished event. `events` holds (index, event): the n choices of one HTTP request share a
    queue, each Generation tagging its events with its choice's index."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: float,
        on_finished: Callable[[Generation, Finished], None],
        index: int = 0,
        events: asyncio.Queue[tuple[int, Event]] | None = None,
    ):
        self._waker = waker(loop)
        self._on_finished = on_finished
        self.deadline = deadline
        self.index = index
        self.events: asyncio.Queue[tuple[int, Event]] = events if events is not None else asyncio.Queue()
        self._started = False  # the engine thread has posted an event
        self.finished: asyncio.Future[Finished] = loop.create_future()
        #: done at the first event (a token or the end): the failover watches it
        self.first: asyncio.Future[None] = loop.create_future()
        self.timed_out = False
        #: the engine's handle, set by the submit right after this is made (its on_event is the callback)
        self.handle: RequestHandle
        #: the id of the model serving it (the fallback's while degraded), for the metrics: set with the handle
        self.model: str
        #: its priority class, and the units of that class's share it holds (None: no classes)
        self.priority = "default"
        self.ticket: Ticket | None = None
        #: its request's hold on the model: dropped when it ends, so the model is never unloaded under it
        self.lease: Lease | None = None
        #: the prompt's length in tokens, as built for that model (known before the first event)
        self.prompt_tokens = 0
        self.submitted = time.monotonic()

    def on_event(self, event: Event) -> None:
        """Called on the engine thread: hand over and return at once. The first event (the time
        to first token) and Finished wake the loop now; the others wait for the loop's timer."""
        urgent = not self._started or isinstance(event, Finished)
        self._started = True
        self._waker.post(self, event, urgent)

    def _deliver(self, event: Event) -> None:
        self.events.put_nowait((self.index, event))
        if not self.first.done():
            self.first.set_result(None)
        if isinstance(event, Finished) and not self.finished.done():
            self.finished.set_result(event)
            self._on_finished(self, event)

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def batch(self, keepalive: float | None = None) -> Batch:
        """What the engine sent since the last call, for every choice sharing this queue,
        waiting for at least one event: under load several tokens queue up between two writes,
        and every API sends them as one. Waits at most `keepalive` seconds (an idle batch, for
        the stream's keep-alive) and never past the deadline (an expired batch: the caller
        cancels the request)."""
        remaining = self.remaining()
        try:
            first = await asyncio.wait_for(self.events.get(), remaining if keepalive is None else min(remaining, keepalive))
        except asyncio.TimeoutError:
            return Batch(idle=True) if keepalive is not None and remaining > keepalive else Batch(expired=True)
        by_choice: dict[int, list[Event]] = {}
        for index, event in [first, *(self.events.get_nowait() for _ in range(self.events.qsize()))]:
            by_choice.setdefault(index, []).append(event)
        return Batch([_part(index, events) for index, events in sorted(by_choice.items())])

    def time_out(self) -> None:
        self.timed_out = True
        self.handle.cancel()


class Lease:
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


class Started(NamedTuple):
    """A launched request under way: the model answering (the dispatcher's Served: the
    fallback's after a failover), its request as built for that model, a Generation per choice."""

    served: Any
    request: ChatRequest
    gens: list[Generation]


def abandon(start: asyncio.Future) -> None:
    """The client left while its launched request (the dispatcher's launch task, giving its
    Started) still waited: it leaves its class's queue, or, if it had just started, its answers
    are cancelled."""
    if not start.cancel() and not start.cancelled() and start.exception() is None:
        for gen in start.result().gens:
            gen.handle.cancel()


@dataclass
class Part:
    """One choice's share of a Batch: the thoughts and the answer text that came, the calls it
    made and the end if it came."""

    index: int = 0
    thought: str = ""
    text: str = ""
    finished: Finished | None = None
    #: with ChatRequest.logprobs: those of the answer's tokens that came (None: not asked for)
    logprobs: list[TokenLogprob] | None = None
    #: with tools declared: the calls the answer made in this batch, in order
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Batch:
    """One Generation.batch(): a Part per choice that had events, in index order; or nothing
    yet (`idle`: the keep-alive's time came) or nothing in time (`expired`: the deadline)."""

    parts: list[Part] = field(default_factory=list)
    idle: bool = False
    expired: bool = False


def _part(index: int, events: list[Event]) -> Part:
    deltas = [e for e in events if isinstance(e, TextDelta)]
    answer = [d for d in deltas if not d.reasoning]
    return Part(index, "".join(d.text for d in deltas if d.reasoning), "".join(d.text for d in answer),
                next((e for e in events if isinstance(e, Finished)), None),
                logprobs=[e for d in answer for e in d.logprobs or ()] if any(d.logprobs is not None for d in answer) else None,
                calls=[e.call for e in events if isinstance(e, ToolCallEvent)])
