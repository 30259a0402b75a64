"""Priority classes: each its own share of the engine's sequences and its own queue, so a burst
from one class (agents firing dozens of calls) cannot starve another (a person chatting).

The engine admits in arrival order from one queue, so isolation happens before it: a request
takes units of its class's share (one per choice) before it is submitted, waiting in its
class's queue while the share is in use. With the shares summing to at most the engine's
parallel sequences, an admitted request always finds a free sequence, and a class whose share
is free is admitted at once, however long the other's queue. A full class queue is a 429 whose
Retry-After is that queue's expected wait (its length over the share, times the class's
measured time per request).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

from edgechat.errors import UsageError


@dataclass(frozen=True)
class PriorityClass:
    name: str
    #: sequences its requests may hold at once
    share: int
    #: requests that may wait for the share; one more is refused with 429
    queue: int = 64


def parse_class(text: str) -> PriorityClass:
    """`name=share` or `name=share:queue` (the command line's --priority-class)."""
    name, _, rest = text.partition("=")
    share, _, queue = rest.partition(":")
    try:
        cls = PriorityClass(name.strip(), int(share), int(queue) if queue else PriorityClass.queue)
    except ValueError:
        cls = None
    if cls is None or not cls.name or cls.share < 1 or cls.queue < 0:
        raise UsageError(f"--priority-class {text!r}: write NAME=SHARE or NAME=SHARE:QUEUE (SHARE >= 1 sequences, QUEUE >= 0 requests)")
    return cls


class ClassFull(Exception):
    """The class's queue is full; `retry_after` is about when a place frees."""

    def __init__(self, name: str, retry_after: int):
        super().__init__(name)
        self.name, self.retry_after = name, retry_after


@dataclass(eq=False)
class Ticket:
    cls: str
    units: int
    admitted: asyncio.Future
    since: float = field(default_factory=time.monotonic)
    #: units given back so far (one per finished choice)
    released: int = 0


class _ClassState:
    def __init__(self, cls: PriorityClass):
        self.cls = cls
        self.running = 0  # units held
        self.waiting: deque[Ticket] = deque()
        #: moving average of how long a request holds its units (Retry-After's clock)
        self.hold_s = 1.0


class PriorityGate:
    """Admission by class; used on the event loop only."""

    ALPHA = 0.3

    def __init__(self, classes: tuple[PriorityClass, ...], n_parallel: int):
        total = sum(c.share for c in classes)
        if total > n_parallel:
            raise UsageError(
                f"the priority classes' shares add up to {total} sequences, more than the {n_parallel} the model runs at once (--parallel)"
            )
        self.states = {c.name: _ClassState(c) for c in classes}

    def __contains__(self, name: str) -> bool:
        return name in self.states

    def share(self, name: str) -> int:
        return self.states[name].cls.share

    def reserve(self, name: str, units: int) -> Ticket:
        """A place for `units` sequences of class `name`: admitted at once if its share has room
        and nobody of its class waits, else queued; raises ClassFull if the queue is full."""
        state = self.states[name]
        ticket = Ticket(name, units, asyncio.get_running_loop().create_future())
        if not state.waiting and state.running + units <= state.cls.share:
            state.running += units
            ticket.admitted.set_result(True)
            return ticket
        if len(state.waiting) >= state.cls.queue:
            raise ClassFull(name, self.retry_after(name))
        state.waiting.append(ticket)
        return ticket

    def release(self, ticket: Ticket, units: int = 1) -> None:
        """Give back units of an admitted ticket (each choice as it ends), or drop a waiting one."""
        state = self.states[ticket.cls]
        if not ticket.admitted.done():
            state.waiting.remove(ticket)
            ticket.admitted.cancel()
            return
        units = min(units, ticket.units - ticket.released)
        if units <= 0:
            return
        ticket.released += units
        state.running -= units
        if ticket.released == ticket.units:
            state.hold_s += self.ALPHA * (time.monotonic() - ticket.since - state.hold_s)
        self._admit(state)

    def release_all(self, ticket: Ticket) -> None:
        self.release(ticket, ticket.units)

    def _admit(self, state: _ClassState) -> None:
        # in order: the head waits for room rather than being overtaken by smaller requests
        while state.waiting and state.running + state.waiting[0].units <= state.cls.share:
            ticket = state.waiting.popleft()
            state.running += ticket.units
            ticket.since = time.monotonic()
            ticket.admitted.set_result(True)

    def retry_after(self, name: str) -> int:
        """Seconds until a place in the class's queue is likely free: the requests ahead, over
        the share working on them, times the time one takes."""
        state = self.states[name]
        ahead = len(state.waiting) + 1
        return max(1, min(60, math.ceil(ahead / state.cls.share * state.hold_s)))

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {n: {"running": s.running, "waiting": len(s.waiting), "share": s.cls.share} for n, s in self.states.items()}
