"""The engine-to-event-loop bridge: every stream's events arrive, in order, and the streams share
the loop's wake-ups (on 2 cores each wake-up makes the engine thread wait for the GIL)."""

from __future__ import annotations

import asyncio
import threading
import time

from edgechat.engine.types.request import Finished, RequestMetrics, TextDelta
from edgechat.server.bridge import STREAM_FLUSH_S, Generation


def test_only_a_streams_start_and_end_wake_the_loop_and_nothing_is_lost_or_late():
    steps, step_s = 40, 0.010

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
        posted = {}

        def engine():  # 4 sequences decoding together: a token each per step
            for step in range(steps):
                for g in gens:
                    posted[g.index, f"{step} "] = time.monotonic()
                    g.on_event(TextDelta(f"{step} "))
                time.sleep(step_s)
            for g in gens:
                g.on_event(Finished("stop", "", RequestMetrics()))

        got = {i: [] for i in range(4)}
        late = []

        async def consume():
            ended = 0
            while ended < 4:
                i, event = await events.get()
                got[i].append(event)
                if isinstance(event, Finished):
                    ended += 1
                else:
                    late.append(time.monotonic() - posted[i, event.text])

        thread = threading.Thread(target=engine)
        thread.start()
        await asyncio.wait_for(consume(), 10)
        thread.join()
        return wakes, got, late

    wakes, got, late = asyncio.run(main())
    for events in got.values():
        assert [e.text for e in events[:-1]] == [f"{step} " for step in range(steps)]
        assert isinstance(events[-1], Finished)
    # the engine thread wakes the loop for each stream's first event and its end, no more (each
    # wake-up hands the GIL to the loop's thread); the tokens between go on the loop's timer
    assert len(wakes) <= 2 * 4, len(wakes)
    # on the loop's timer a token waits up to STREAM_FLUSH_S; held to the end, the first would wait ~0.4 s
    assert max(late) < 4 * STREAM_FLUSH_S, max(late)
