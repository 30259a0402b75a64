"""The engine-to-event-loop bridge: every stream's events arrive, in order, and the streams share
the loop's wake-ups (on 2 cores each wake-up makes the engine thread wait for the GIL)."""

from __future__ import annotations

import asyncio
import threading
import time

from edgechat.engine.request import Finished, RequestMetrics, TextDelta
from edgechat.server.bridge import STREAM_FLUSH_S, Generation


def test_streams_share_the_loops_wake_ups_and_lose_nothing():
    steps, step_s = 20, 0.010

    async def main():
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            wakes.append(time.monotonic())
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        events = asyncio.Queue()
        gens = [Generation(loop, time.monotonic() + 60, lambda g, f: None, i, events) for i in range(4)]

        def engine():  # 4 sequences decoding together: a token each per step
            for step in range(steps):
                for g in gens:
                    g.on_event(TextDelta(f"{step} "))
                time.sleep(step_s)
            for g in gens:
                g.on_event(Finished("stop", "", RequestMetrics()))

        started = time.monotonic()
        thread = threading.Thread(target=engine)
        thread.start()
        await asyncio.wait_for(asyncio.gather(*(g.finished for g in gens)), 10)
        thread.join()
        got = {i: [] for i in range(4)}
        while not events.empty():
            i, event = events.get_nowait()
            got[i].append(event)
        return wakes, got, time.monotonic() - started

    wakes, got, elapsed = asyncio.run(main())
    for events in got.values():
        assert [e.text for e in events[:-1]] == [f"{step} " for step in range(steps)]
        assert isinstance(events[-1], Finished)
    # the first event and the end at once; in between one wake-up per 25 ms for all four streams
    # (a wake-up per stream would be 4x as many: 32 here)
    assert len(wakes) <= elapsed / STREAM_FLUSH_S + 3, (len(wakes), elapsed)
