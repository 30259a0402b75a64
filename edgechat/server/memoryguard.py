"""The memory floor: while serving, the free memory (the least of MemAvailable and what the
memory cgroup's limit leaves) is read at most once a second as requests arrive. Below the floor
the server sheds, in order and saying so in the log: the prompt cache's states in RAM (those on
disk stay), then the models no request holds, then new requests (a 503 with Retry-After, which
clients retry), so the answers in progress finish instead of the process being killed by the
OOM killer or Android's low-memory killer. A quarter above the floor it is back to normal."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from edgechat import sysmem
from edgechat.engine.pool import ModelPool

log = logging.getLogger("edgechat.server")

#: the default floor: this share of the memory the server may use (its cgroup's limit, else RAM)
FLOOR_SHARE = 0.10
MIN_FLOOR = 256 << 20
#: back to normal this far above the floor (no flapping on the edge)
HYSTERESIS = 1.25
#: seconds between two readings
INTERVAL_S = 1.0


def default_floor(reading: sysmem.MemoryReading, total: int) -> int:
    return max(MIN_FLOOR, int(FLOOR_SHARE * (reading.cgroup_limit or total)))


class MemoryGuard:
    def __init__(self, floor: int | None, pool: ModelPool, read: Callable[[], sysmem.MemoryReading] = sysmem.read,
                 on_pressure: Callable[[bool, str], None] | None = None):
        #: None or 0: never shed
        self.floor = floor or None
        self.pool = pool
        self.read = read
        #: told (True, why) when memory falls under the floor, (False, why) when it is back: the degrade switch
        self.on_pressure = on_pressure or (lambda short, why: None)
        #: refusing new requests until memory is back above the floor
        self.short = False
        self._shed_cache = self._shed_models = False
        self._checked = 0.0
        self._lock = asyncio.Lock()

    async def admit(self) -> bool:
        """Whether a new request may start now, shedding first where memory is short."""
        if self.floor is None:
            return True
        now = time.monotonic()
        if now - self._checked < INTERVAL_S:
            return not self.short
        async with self._lock:
            self._checked = time.monotonic()
            await asyncio.to_thread(self._check)
        return not self.short

    def _free(self) -> int | None:
        return self.read().headroom()

    def _check(self) -> None:
        assert self.floor is not None
        free = self._free()
        if free is None:
            return
        if free >= self.floor * HYSTERESIS:
            if self._shed_cache or self.short:
                log.info("memory: %s free, above the floor of %s again: back to normal", _mib(free), _mib(self.floor))
                self.on_pressure(False, f"{_mib(free)} free, above the floor again")
            self._shed_cache = self._shed_models = self.short = False
            return
        if free >= self.floor:
            return
        if not self._shed_cache:
            self.on_pressure(True, f"{_mib(free)} free, under the floor of {_mib(self.floor)}")
            self._shed_cache = True
            freed = sum(m.engine.shed_prompt_cache() for m in self.pool.resident() if m.engine is not None and m.engine.stopped is None)
            log.warning("memory: %s free, under the floor of %s: the prompt cache let go of %s in RAM", _mib(free), _mib(self.floor), _mib(freed))
            if (free := self._free() or 0) >= self.floor:
                return
        if not self._shed_models:
            self._shed_models = True
            gone = [m.name for m in self.pool.resident() if not m.users and not m.pinned and self.pool.unload(m.name)]
            if gone:
                log.warning("memory: %s free, under the floor of %s: unloaded %s, which no request held", _mib(free), _mib(self.floor), ", ".join(gone))
                if (free := self._free() or 0) >= self.floor:
                    return
        if not self.short:
            self.short = True
            log.warning("memory: %s free, under the floor of %s: new requests are refused (503, Retry-After) until it is back",
                        _mib(free), _mib(self.floor))


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
