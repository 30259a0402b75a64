"""The engine-to-asyncio bridge: one submitted request as the event loop sees it.

The engine calls back on its own thread; call_soon_threadsafe carries the events into the event
loop, where a handler awaits `finished` or reads `events`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from edgechat.engine.request import Event, Finished

#: the engine wakes the event loop at most this often per streaming request
STREAM_FLUSH_S = 0.025


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
        self._loop = loop
        self._on_finished = on_finished
        self.deadline = deadline
        self.index = index
        self.events: asyncio.Queue[tuple[int, Event]] = events if events is not None else asyncio.Queue()
        self._lock = threading.Lock()
        self._buffer: list[Event] = []
        self._last_signal = 0.0
        self.finished: asyncio.Future[Finished] = loop.create_future()
        #: done at the first event (a token or the end): the failover watches it
        self.first: asyncio.Future[None] = loop.create_future()
        self.timed_out = False
        self.handle = None
        #: the id of the model serving it (the fallback's while degraded), for the metrics
        self.model: str | None = None
        #: its priority class, and the units of that class's share it holds (None: no classes)
        self.priority = "default"
        self.ticket = None
        self.submitted = time.monotonic()

    def on_event(self, event: Event) -> None:
        """Called on the engine thread: hand over and return at once. The event loop is woken at
        most every STREAM_FLUSH_S (the first event and Finished at once): on a 2-core machine a
        wake-up per token takes CPU from llama.cpp's threads. A held event goes with the next."""
        now = time.monotonic()
        with self._lock:
            self._buffer.append(event)
            if not isinstance(event, Finished) and self._last_signal and now - self._last_signal < STREAM_FLUSH_S:
                return
            self._last_signal = now
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:
            # the loop is closed: the server is shutting down and nobody is listening
            pass

    def _flush(self) -> None:
        with self._lock:
            events, self._buffer = self._buffer, []
        for event in events:
            self._deliver(event)

    def _deliver(self, event: Event) -> None:
        self.events.put_nowait((self.index, event))
        if not self.first.done():
            self.first.set_result(None)
        if isinstance(event, Finished) and not self.finished.done():
            self.finished.set_result(event)
            self._on_finished(self, event)

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def time_out(self) -> None:
        self.timed_out = True
        self.handle.cancel()
