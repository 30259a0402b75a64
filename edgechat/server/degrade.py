"""The degrade switch: when requests keep waiting too long for a sequence, or memory is under
the server's floor, answer shorter.

Queue wait is the signal because it is what an overloaded server adds for everyone; capping
max_tokens shortens each running answer, so the queue drains faster. A moving average keeps one
slow request from flipping it; hysteresis (off below half the threshold, or as soon as the
queue is empty) keeps it from flapping. Memory is the other signal: while the memory guard
(memoryguard.py) is under its floor the switch is on too, whatever the queue, so answers end
sooner and hand their sequences back while the guard sheds; it goes off when the guard is back
to normal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("edgechat.server")


class DegradeSwitch:
    def __init__(
        self,
        threshold_s: float | None,
        max_tokens_cap: int,
        alpha: float = 0.3,
        on_switch: Callable[[bool], None] | None = None,
    ):
        #: None or 0 disables the switch
        self.threshold_s = threshold_s or None
        self.max_tokens_cap = max_tokens_cap
        self.alpha = alpha
        self.avg_wait = 0.0
        #: on for queue wait, and on for memory under the floor: either caps max_tokens
        self.queue_active = False
        self.memory_short = False
        self._on_switch = on_switch

    @property
    def active(self) -> bool:
        return self.queue_active or self.memory_short

    def memory(self, short: bool, why: str) -> None:
        """The memory guard's signal: under its floor (`short`) or back to normal."""
        if short != self.memory_short:
            self._switch("memory_short", short, f"memory: {why}")

    def observe(self, queue_wait: float) -> None:
        """A request left the queue after `queue_wait` seconds (turning off is on_admit's call,
        as only it sees whether anyone is still queued)."""
        self.avg_wait += self.alpha * (queue_wait - self.avg_wait)
        if self.threshold_s is not None and not self.queue_active and self.avg_wait > self.threshold_s:
            self._set(True, f"queue wait averages {self.avg_wait:.1f} s, over {self.threshold_s:g} s")

    def on_admit(self, waiting: int, oldest_wait: float) -> None:
        """A request arrives; `oldest_wait` is how long the oldest still-queued request has waited.

        That live age reacts at once to a growing queue, before any queued request finishes.
        """
        if waiting == 0:
            # nobody is queued: the load has fallen, whatever the average remembers
            self.avg_wait = min(self.avg_wait, (self.threshold_s or 0.0) / 2)
            if self.queue_active:
                self._set(False, "the queue is empty")
            return
        if self.threshold_s is None:
            return
        signal = max(self.avg_wait, oldest_wait)
        if not self.queue_active and signal > self.threshold_s:
            self._set(True, f"requests wait {signal:.1f} s for a sequence, over {self.threshold_s:g} s")
        elif self.queue_active and signal < self.threshold_s / 2:
            self._set(False, f"queue wait down to {signal:.1f} s")

    def cap(self, max_tokens: int | None) -> int | None:
        if not self.active:
            return max_tokens
        return self.max_tokens_cap if max_tokens is None else min(max_tokens, self.max_tokens_cap)

    def _set(self, active: bool, why: str) -> None:
        self._switch("queue_active", active, why)

    def _switch(self, signal: str, on: bool, why: str) -> None:
        """Set one signal (`queue_active`, `memory_short`); tell and log where the switch as a whole flipped."""
        was = self.active
        setattr(self, signal, on)
        if self.active == was:
            return
        if self._on_switch is not None:
            self._on_switch(self.active)
        if self.active:
            log.warning("degrade switch on (%s): max_tokens capped at %d", why, self.max_tokens_cap)
        else:
            log.warning("degrade switch off (%s)", why)
