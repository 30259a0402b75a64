"""The image encoder: a request's pictures are encoded on a thread of their own, one at a time,
while the engine thread decodes the other requests' tokens."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from edgechat.engine.kv.kvcache import is_sentinel
from edgechat.engine.schedule.running import Running

if TYPE_CHECKING:
    from edgechat.engine.runners.media import Projector


class ImageEncoder:
    """Encodes the images of a request's pending prompt; `wake` tells the engine thread an
    encode ended (it may sleep while every running request waits for one)."""

    def __init__(self, projector: Projector, wake: Callable[[], None]):
        self.projector = projector
        self._pool = ThreadPoolExecutor(1, "edgechat-encode")
        self._wake = wake

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def start(self, run: Running) -> None:
        """Start encoding the images the cache does not hold (a cached one is never encoded
        again), in prompt order."""
        i, pending = 0, run.pending
        while i < len(pending):
            if not is_sentinel(pending[i]):
                i += 1
                continue
            chunk = run.prep.media[pending[i]]  # the KV manager never keeps part of an image
            future = self._pool.submit(self.projector.encode, chunk)
            future.add_done_callback(lambda _: self._wake())
            run.encodes[pending[i]] = future
            i += chunk.n_tokens

    @staticmethod
    def take(run: Running) -> np.ndarray | None:
        """The embeddings of the image at the head of the run's pending prompt, once encoded
        (None while its encode runs); raises what the encode raised."""
        first = run.pending[0]
        future = run.encodes.get(first)
        if future is None or not future.done():
            return None
        del run.encodes[first]
        return future.result()

    @staticmethod
    def waiting(active: list[Running]) -> bool:
        """A running request waits for an image's encode."""
        return any(not f.done() for run in active for f in run.encodes.values())
