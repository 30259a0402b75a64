"""What the scheduler tracks of a request in the step loop, and what one step runs."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import InitVar, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from edgechat.engine.kv.kvcache import Slot
from edgechat.engine.output.answer import Answer
from edgechat.engine.prompt.prompt import Prepared
from edgechat.engine.runners.runner import TokenBatch
from edgechat.engine.runners.sampling import SamplerChain
from edgechat.engine.schedule.speculative import Guesses
from edgechat.engine.types.metrics import RequestClock
from edgechat.engine.types.request import ChatRequest, RequestHandle

if TYPE_CHECKING:
    from edgechat.engine.runners.media import MediaChunk


class Phase(Enum):
    """Where a request is in the step loop: what it puts in the next step's batch."""

    WAITING = "waiting"  # queued: no sequence yet
    PREFILLING = "prefilling"  # prompt tokens, images (or a budget's closing tokens) still to go in
    SAMPLING = "sampling"  # its last tokens are in this step: the next token is chosen from their logits
    DECODING = "decoding"  # a sampled token waits to go into the cache
    FINISHED = "finished"


@dataclass
class Running:
    """A submitted request as the scheduler tracks it, from the queue to its end; its output
    (text, events, end rules) is its `answer`'s."""

    handle: RequestHandle
    request: ChatRequest
    prep: Prepared
    clock: InitVar[RequestClock]
    phase: Phase = Phase.WAITING
    queued: bool = True  # counted in Scheduler.n_waiting
    slot: Slot | None = None
    sampler: SamplerChain | None = None
    #: prompt tokens still to prefill; an image's cells are a run of sentinels (engine/runners/media.py)
    pending: list[int] = field(default_factory=list)
    #: the encodes of the images in `pending`, by first sentinel (the encoder thread's work)
    encodes: dict[int, Future] = field(default_factory=dict)
    next_token: int = -1  # sampled, not yet in the KV cache (Phase.DECODING)
    out_index: int = -1  # batch index whose logits this request samples from
    guesses: Guesses | None = None  # speculative decoding, when the request's mode drafts
    answer: Answer = field(init=False)
    #: [start, length] of each message still evictable, moved as Scheduler._make_room drops the oldest
    spans: list[list[int]] = field(init=False)

    def __post_init__(self, clock: RequestClock):
        self.answer = Answer(self.handle, self.request, clock)
        self.spans = [list(span) for span in self.prep.spans]  # the shared Prepared stays as built


@dataclass
class MediaStep:
    """An encoded image going into a sequence's cells at positions from `pos`."""

    run: Running
    chunk: MediaChunk
    embeddings: np.ndarray
    pos: int


@dataclass
class StepPlan:
    """What one step runs (`batch`, after `media`: at most one image, decoded first, so text
    after it may ride in the batch) and for whom: the sequences whose sampled token (and
    drafts) are in it, and those whose prompt's last chunk is."""

    batch: TokenBatch
    decoding: list[Running] = field(default_factory=list)
    prompted: list[Running] = field(default_factory=list)
    media: MediaStep | None = None
