"""The scheduler: which requests run, and one step of them all.

Runs on the engine thread only. Waiting requests are admitted when a sequence is free (the KV
manager picks it and reuses what it can); each step decodes one token for every running
sequence and a chunk of every prompt still being prefilled, all in one llama_decode (continuous
batching); sampled tokens go through each request's output processor to its handle. Every
request ends in `finish`, which frees what it holds before its client hears of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from edgechat.engine.kv.kvcache import MIN_FILL_REALIGN, KVManager, Slot, is_sentinel
from edgechat.engine.kv.sessions import ConversationStates
from edgechat.engine.output.jsonvalue import JsonPrefix, step_texts
from edgechat.engine.output.logprobs import token_logprobs
from edgechat.engine.output.reasoning import ChannelFormat, ReasoningFormat, Thinking
from edgechat.engine.output.stream import OutputProcessor
from edgechat.engine.output.toolfamilies import GENERIC, ToolFamily
from edgechat.engine.output.tools import ToolCallParser, answered_calls
from edgechat.engine.prompt.prompt import Prepared
from edgechat.engine.runners.runner import ModelRunner, TokenBatch
from edgechat.engine.runners.sampling import SamplerChain
from edgechat.engine.schedule.draft import DraftModel
from edgechat.engine.schedule.speculative import MAX_DRAFT, DraftPolicy, NgramDrafter, StepCost
from edgechat.engine.types.metrics import RequestClock
from edgechat.engine.types.request import (
    FINISH_REASONS,
    ChatRequest,
    ContextPolicy,
    Evicted,
    Finished,
    Metrics,
    RequestHandle,
    RequestStatus,
    TextDelta,
    TokenLogprob,
    ToolCallEvent,
)
from edgechat.errors import EngineBusyError
from edgechat.params import SpeculativeMode

if TYPE_CHECKING:
    from edgechat.engine.runners.media import MediaChunk, Projector

log = logging.getLogger("edgechat.engine")

#: prompt tokens prefilled per step while other sequences are decoding (chunked prefill):
#: one llama.cpp ubatch, so a long prompt never stalls the running streams for more than that
PREFILL_CHUNK_BUSY = 512


#: how close to max_tokens an answer held to a JSON Schema starts checking what its end would take
JSON_CLOSE_WINDOW = 64

class Phase(Enum):
    """Where a request is in the step loop: what it puts in the next step's batch."""

    WAITING = "waiting"  # queued: no sequence yet
    PREFILLING = "prefilling"  # prompt tokens, images (or a budget's closing tokens) still to go in
    SAMPLING = "sampling"  # its last tokens are in this step: the next token is chosen from their logits
    DECODING = "decoding"  # a sampled token waits to go into the cache
    FINISHED = "finished"


@dataclass
class Running:
    """A submitted request as the scheduler tracks it, from the queue to its end."""

    handle: RequestHandle
    request: ChatRequest
    prep: Prepared
    clock: RequestClock
    phase: Phase = Phase.WAITING
    queued: bool = True  # counted in Scheduler.n_waiting
    slot: Slot | None = None
    sampler: SamplerChain | None = None
    proc: OutputProcessor | None = None
    #: prompt tokens still to prefill; an image's cells are a run of sentinels (engine/runners/media.py)
    pending: list[int] = field(default_factory=list)
    #: the encodes of the images in `pending`, by first sentinel (the encoder thread's work)
    encodes: dict[int, Future] = field(default_factory=dict)
    next_token: int = -1  # sampled, not yet in the KV cache (Phase.DECODING)
    out_index: int = -1  # batch index whose logits this request samples from
    n_out: int = 0
    cached: int = 0
    restored: int | None = None  # prompt tokens from the prompt cache (None: not consulted)
    tokens_out: list[int] = field(default_factory=list)
    drafter: NgramDrafter | None = None
    policy: DraftPolicy | None = None  # how much of the n-gram drafter's guesses to try
    model_policy: DraftPolicy | None = None  # how many tokens the draft model guesses
    drafted_by: DraftPolicy | None = None  # the policy of this step's draft
    draft: list[int] = field(default_factory=list)  # drafted tokens in this step's batch
    draft_indices: list[int] = field(default_factory=list)  # batch indices of the logits to verify them
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per sampled token, when asked
    logprobs_sent: int = 0  # of which delivered with a TextDelta
    #: an answer held to a JSON Schema under max_tokens: the JSON so far (how far it has read
    #: the answer's text), and the last closing counted, to end it validly in time
    json: JsonPrefix | None = None
    json_read: int = 0
    json_closing: tuple[str, list[int]] = ("", [])
    #: the most tokens one step can add to that closing (a key or an item opened: step_texts),
    #: counted once the answer first comes near max_tokens
    json_step: int | None = None
    #: [start, length] of each message still evictable, moved as _make_room drops the oldest
    spans: list[list[int]] = field(init=False)

    def __post_init__(self):
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


def _text_run(tokens: list[int], limit: int) -> int:
    """How many of the first `limit` tokens come before the first image cell."""
    for i in range(min(limit, len(tokens))):
        if is_sentinel(tokens[i]):
            return i
    return min(limit, len(tokens))


class Scheduler:
    """Plans each step (`schedule`), has the model runner run it, applies the result
    (`update`): admission, chunked prefill, drafts and their verification, the end of every
    request. The KV manager alone changes the cache; the output processor alone makes text."""

    def __init__(
        self,
        runner: ModelRunner,
        kv: KVManager,
        states: ConversationStates,
        n_ctx: int,
        n_parallel: int,
        policy: Callable[[ChatRequest], ContextPolicy],
        speculative: Callable[[ChatRequest], SpeculativeMode],
        draft: DraftModel | None = None,
        deterministic: bool = False,
        reasoning: ReasoningFormat | ChannelFormat | None = None,
        projector: Projector | None = None,
        wake: Callable[[], None] = lambda: None,
        tool_family: ToolFamily = GENERIC,
    ):
        self.runner = runner
        self.kv = kv
        self.states = states
        self.n_ctx = n_ctx
        self.n_parallel = n_parallel
        self.policy = policy
        self.speculative = speculative
        self.draft = draft
        #: each request alone on an empty cache (EngineConfig.deterministic; n_parallel is then 1)
        self.deterministic = deterministic
        #: the model's thinking markers, its splitters and the tokens that close its thoughts at a budget
        self.thinking = Thinking(reasoning, runner.tokenize)
        #: the call syntax the model's template writes: a request with tools reads its calls in it
        self.tool_family = tool_family
        #: what a wider batch costs on this machine, measured on every step
        self.cost = StepCost()
        self.waiting: deque[Running] = deque()
        self.active: list[Running] = []
        #: requests submitted and not yet started or ended (read by any thread)
        self.n_waiting = 0
        self._count_lock = threading.Lock()
        #: llama_decode calls of the step loop: batching shows as fewer calls than tokens
        self.decode_calls = 0
        self._batch = runner.new_batch(runner.n_batch)
        self.projector = projector
        #: images are encoded here, one at a time, while the engine thread decodes the others'
        #: tokens; `wake` tells the engine thread an encode ended
        self._encoder = ThreadPoolExecutor(1, "edgechat-encode") if projector is not None else None
        self._wake = wake

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.shutdown(wait=True, cancel_futures=True)
        self._batch.close()

    @property
    def encoding(self) -> bool:
        """A running request waits for an image's encode (the engine thread may sleep until it ends)."""
        return any(not f.done() for run in self.active for f in run.encodes.values())

    # ------------------------------------------------------------------ the queue (any thread)
    def reserve(self, max_queue: int | None) -> None:
        """Count one more waiting request, or refuse it when the queue is full."""
        with self._count_lock:
            # requests that a free sequence will take at the next step are not queued
            free = max(self.n_parallel - len(self.active), 0)
            if max_queue is not None and self.n_waiting - free >= max_queue:
                raise EngineBusyError(f"the engine is busy ({self.n_waiting - free} requests waiting); try again shortly")
            self.n_waiting += 1

    def _dequeue(self, run: Running) -> None:
        if run.queued:
            run.queued = False
            with self._count_lock:
                self.n_waiting -= 1

    # ------------------------------------------------------------------ admission
    def admit(self) -> None:
        still: deque[Running] = deque()
        while self.waiting:
            run = self.waiting.popleft()
            try:
                if run.handle.cancelled:
                    self.finish(run, RequestStatus.FINISHED_CANCELLED)
                    continue
                slot = None
                if len(self.active) < self.n_parallel and not self._awaits_shared_prompt(run):
                    if self.deterministic:
                        slot = self.kv.pick_alone(run.request.session)
                    else:
                        slot = self.kv.pick(run.request.session, run.prep.tokens, self.n_ctx)
                if slot is None:
                    still.append(run)
                    continue
                self._dequeue(run)
                self._start(run, slot)
            except Exception as exc:  # this request cannot start (a snapshot it needs, a bug): it alone fails
                log.exception("could not start a request")
                self.finish(run, RequestStatus.FINISHED_ERROR, error=str(exc) or type(exc).__name__)
        self.waiting = still

    def _awaits_shared_prompt(self, run: Running) -> bool:
        """n > 1: a request waits while the one it shares the prompt with is still prefilling it,
        then takes those cells from it (KVManager.pick) instead of computing them again."""
        other = run.request.prompt_shared_with
        if other is None or other.status.finished:
            return False
        return other.status is RequestStatus.WAITING or any(r.handle is other and r.phase is Phase.PREFILLING for r in self.active)

    def _start(self, run: Running, slot: Slot) -> None:
        req, prompt = run.request, run.prep.tokens
        run.slot = slot
        self.kv.occupy(slot)
        run.clock.admitted = time.perf_counter()
        run.handle.status = RequestStatus.RUNNING
        self.active.append(run)
        if req.session is not None:
            self.states.update(req.session, evicted=run.prep.evicted_total)
            if run.prep.summary:
                self.states.update(req.session, summary=run.prep.summary)
        if run.prep.evicted_now:
            n = run.prep.evicted_now
            run.handle.emit(Evicted(n, 0, self.policy(req).value, f"{n} oldest message{'s' if n > 1 else ''} left the context"))
        if req.infill is not None:
            # the cursor moved down past the prefix's budget: the file's start left the prompt,
            # and what follows it is still in the cache
            run.cached = self.kv.reuse(slot, prompt, True, MIN_FILL_REALIGN)
        else:
            run.cached = self.kv.reuse(slot, prompt, req.session is not None and self.policy(req) is ContextPolicy.SHIFT)
        run.restored = slot.cache_restored if slot.cache_restored is None else min(slot.cache_restored, run.cached)
        run.pending = prompt[run.cached :]
        run.phase = Phase.PREFILLING if run.pending else Phase.SAMPLING
        self._encode_images(run)
        run.sampler = SamplerChain(req.sampling, self.runner.n_vocab, self.runner.vocab, req.grammar)
        run.sampler.accept_prompt([t for t in prompt if not is_sentinel(t)] if run.prep.media else prompt)
        if req.grammar is not None and req.grammar.json_schema is not None and req.max_tokens is not None:
            run.json = JsonPrefix(req.grammar.json_schema)
        tools = req.tools if req.tools is not None and req.tools.active else None
        run.proc = OutputProcessor(req.stop, loop_guard=req.loop_guard and not req.ignore_eos,
                                   splitter=self.thinking.splitter(req, run.prep),
                                   parser=ToolCallParser(self.tool_family, tools.offered, answered_calls(req.messages))
                                   if tools is not None else None)
        mode = self.speculative(req)
        if mode in (SpeculativeMode.AUTO, SpeculativeMode.LOOKUP):
            run.drafter = NgramDrafter(prompt)
            run.policy = DraftPolicy(forced=mode is SpeculativeMode.LOOKUP)
        # the draft model reads token ids only: a sequence holding an image gets no guesses from it
        if self.draft is not None and mode in (SpeculativeMode.AUTO, SpeculativeMode.DRAFT) and not run.prep.media:
            run.model_policy = DraftPolicy(forced=mode is SpeculativeMode.DRAFT)
        if run.cached == len(prompt):
            # the whole prompt is cached with the logits after it (KVManager.reuse): the first
            # token is chosen now, and the next step decodes it with the others
            self._prompt_read(run)
            assert slot.next_logits is not None  # reuse counts the whole prompt only with its logits
            status = self._on_token(run, self._sample(run, kept=slot.next_logits.values))
            if status is not None:
                self.finish(run, status)

    def _encode_images(self, run: Running) -> None:
        """Start encoding the images the cache does not hold (a cached one is never encoded
        again), in prompt order on the encoder thread."""
        if not run.prep.media:
            return
        assert self._encoder is not None and self.projector is not None  # the prompt builder refuses images otherwise
        i, pending = 0, run.pending
        while i < len(pending):
            if not is_sentinel(pending[i]):
                i += 1
                continue
            chunk = run.prep.media[pending[i]]  # the KV manager never keeps part of an image
            future = self._encoder.submit(self.projector.encode, chunk)
            future.add_done_callback(lambda _: self._wake())
            run.encodes[pending[i]] = future
            i += chunk.n_tokens

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """Plan a step, have the runner run it, apply what it computed; False when there was
        nothing to run (every running request waits for an image's encode)."""
        plan = self.schedule()
        if plan is None:
            return False
        if plan.media is not None:
            media = plan.media
            assert self.projector is not None and media.run.slot is not None
            self.projector.decode(media.chunk, media.embeddings, media.run.slot.seq, media.pos)
            self.decode_calls += 1
        if plan.batch.n:
            started = time.perf_counter()
            self.runner.decode(plan.batch)
            self.cost.observe(plan.batch.n, time.perf_counter() - started)
            self.decode_calls += 1
        self.update(plan)
        return True

    def schedule(self) -> StepPlan | None:
        """This step's rows: every decoding sequence's sampled token (and drafts after it), then
        prompt chunks while the batch has room (a chunk's size bounded while others decode).
        Cancelled requests end here; a full sequence makes room first. Runs no model (the draft
        model's guesses aside); None when there is nothing to run."""
        batch, kv = self._batch, self.kv
        batch.clear()
        plan = StepPlan(batch)
        for run in list(self.active):
            if run.handle.cancelled:
                self.finish(run, run.handle.end_status)
                continue
            if run.phase is not Phase.DECODING:
                continue
            assert run.slot is not None  # started: every phase after WAITING has its sequence
            if len(run.slot.tokens) >= self.n_ctx:
                self._make_room(run)
            run.out_index = batch.add(run.next_token, run.slot.next_pos, run.slot.seq, True)
            kv.extend(run.slot, [run.next_token])
            run.next_token, run.phase = -1, Phase.SAMPLING
            plan.decoding.append(run)
        if plan.decoding:
            self._add_drafts(plan.decoding)
        for run in list(self.active):
            if run.phase is not Phase.PREFILLING or batch.free == 0:
                continue
            assert run.slot is not None
            room = min(batch.free, PREFILL_CHUNK_BUSY if plan.decoding else batch.free)
            if is_sentinel(run.pending[0]):
                if plan.media is not None or not self._plan_image(run, plan):
                    continue  # one image a step, or its encode is still running
                assert plan.media is not None  # _plan_image planned it
                if plan.decoding:  # an image costs what a prefill chunk of its cells does
                    room = max(room - plan.media.chunk.n_tokens, 0)
                if not room or is_sentinel(run.pending[0]):
                    continue
            room = _text_run(run.pending, room)
            chunk, run.pending = run.pending[:room], run.pending[room:]
            base = run.slot.next_pos
            for i, tok in enumerate(chunk):
                last = not run.pending and i == len(chunk) - 1
                idx = batch.add(tok, base + i, run.slot.seq, last)
            kv.extend(run.slot, chunk)
            if not run.pending:
                run.out_index, run.phase = idx, Phase.SAMPLING
                plan.prompted.append(run)
        return plan if batch.n or plan.media is not None else None

    def _plan_image(self, run: Running, plan: StepPlan) -> bool:
        """Put the image at the head of the run's pending prompt in this step, once encoded."""
        assert run.slot is not None
        first = run.pending[0]
        future = run.encodes.get(first)
        if future is None or not future.done():
            return False
        del run.encodes[first]
        try:
            embeddings = future.result()
        except Exception as exc:  # the projector failed on this picture: its request alone ends
            log.exception("could not encode an image")
            self.finish(run, RequestStatus.FINISHED_ERROR, error=str(exc) or type(exc).__name__)
            return False
        chunk = run.prep.media[first]
        plan.media = MediaStep(run, chunk, embeddings, run.slot.next_pos)
        self.kv.extend(run.slot, run.pending[: chunk.n_tokens], chunk.n_pos)
        run.pending = run.pending[chunk.n_tokens :]
        return True

    def update(self, plan: StepPlan) -> None:
        """The runner ran the plan: keep the logits after each prompt just read, sample every
        sequence's next token (verifying drafts), and pass the tokens on."""
        for run in plan.prompted:
            assert run.slot is not None
            self.kv.keep_logits(run.slot, _frozen(self.runner.logits(run.out_index)))
            self._prompt_read(run)
        for run in plan.decoding + plan.prompted:
            if run.draft:
                self._verify(run)
                continue
            status = self._on_token(run, self._sample(run, run.out_index))
            if status is not None:
                self.finish(run, status)

    def _sample(self, run: Running, index: int = -1, kept: np.ndarray | None = None) -> int:
        """The next token from the logits at a batch index, or from logits kept from an earlier
        decode (`kept`)."""
        smp, be = run.sampler, self.runner
        assert smp is not None
        if kept is not None:
            token = smp.choose(kept)
        elif smp.plain_greedy:
            token = be.argmax(index)
        else:
            allowed = smp.allowed_argmax(be.logits(index)) if smp.grammar_greedy else None
            token = be.sample(smp, index) if allowed is None else allowed
        if run.request.logprobs is not None:
            self._record_logprob(run, be.logits(index) if kept is None else kept, token)
        return token

    def _record_logprob(self, run: Running, logits: np.ndarray, token: int) -> None:
        """Only for requests that ask: the others never read their logits in Python."""
        be, n = self.runner, run.request.logprobs
        assert n is not None
        logprob, top = token_logprobs(logits, token, n)
        run.logprobs.append(TokenLogprob(be.piece(token), logprob, [(be.piece(t), lp) for t, lp in top], token, [t for t, _ in top]))

    def _emit_text(self, run: Running, text: str) -> None:
        """Text to the client, after the thoughts released with it, with the log probabilities
        of the tokens emitted since the last text (the end-of-generation token has none)."""
        if run.proc is None:  # ended before it started: nothing was written
            return
        for part, reasoning in run.proc.parts(text):
            logprobs = None
            if run.request.logprobs is not None:  # the closing tokens of a thinking budget have none
                logprobs = run.logprobs[run.logprobs_sent :]
                run.logprobs_sent = len(run.logprobs)
            run.handle.emit(TextDelta(part, logprobs, reasoning))
        for index, call in run.proc.take_calls():
            run.handle.emit(ToolCallEvent(index, call))

    def _add_drafts(self, decoding: list[Running]) -> None:
        """Put drafted tokens after each decoding sequence's next token, with logits at each."""
        batch = self._batch
        width = len(decoding) + sum(min(len(r.pending), PREFILL_CHUNK_BUSY) for r in self.active if r.phase is Phase.PREFILLING)
        for run in decoding:
            if (run.policy is None and run.model_policy is None) or not self.kv.can_rewind:
                continue
            assert run.slot is not None
            slot = run.slot
            room = min(self.n_ctx - len(slot.tokens), batch.free, MAX_DRAFT)
            if run.request.max_tokens is not None:
                # what this step can emit is the drafted tokens plus one
                room = min(room, run.request.max_tokens - run.n_out - 1)
            if room <= 0:
                continue
            run.draft = self._guess(run, room, width, len(decoding))
            if not run.draft:
                continue
            base = slot.next_pos
            run.draft_indices = [run.out_index] + [batch.add(tok, base + i, slot.seq, True) for i, tok in enumerate(run.draft)]
            self.kv.extend(slot, run.draft)
            width += len(run.draft)

    def _guess(self, run: Running, room: int, width: int, sequences: int) -> list[int]:
        """This step's draft for one sequence: the n-gram lookup's when it has one worth
        trying (it costs nothing to make), else the draft model's when that pays."""
        assert run.slot is not None
        if run.policy is not None:
            assert run.drafter is not None  # made with its policy
            guess = run.drafter.propose(room)
            k = run.policy.length(self.cost, width, sequences, len(guess))
            if k > 0:
                run.drafted_by = run.policy
                return guess[:k]
        if run.model_policy is not None and self.draft is not None:
            k = run.model_policy.length(self.cost, width, sequences, room, *self._draft_cost(run, width))
            if k > 0:
                try:
                    guess = self.draft.propose(run.slot.seq, run.slot.tokens, k)
                except Exception:  # the draft is an aid: its failure costs a guess, never the answer
                    log.exception("the draft model failed to guess")
                    return []
                run.drafted_by = run.model_policy
                return guess
        return []

    def _prompt_read(self, run: Running) -> None:
        """The prompt is in the cache and its first token about to be chosen. The draft model
        reads the prompt now, with the model, so its first guess does not wait for it: the
        prompt's cost goes to the time to first token, as a prefill's does."""
        assert run.slot is not None
        if run.model_policy is None or self.draft is None:
            return
        try:
            self.draft.follow(run.slot.seq, run.slot.tokens)
        except Exception:  # the draft is an aid: its failure costs a guess, never the answer
            log.exception("the draft model failed to read the prompt")

    def _draft_cost(self, run: Running, width: int) -> tuple[float, float]:
        """What the draft model takes to guess one token, and to catch up with the tokens this
        sequence gained since its last guess, in steps of `width` tokens: measured once both
        have run, until then a guess that a token is a third of the model's step. The catch-up
        counts beyond the one token any guess decodes: after a pause it decodes every token of
        the pause, which cost a probe of 2 tokens 20 steps of SmolLM2."""
        assert run.slot is not None and self.draft is not None
        step, guess = self.cost.seconds(width), self.draft.cost.seconds(1)
        behind = self.draft.behind(run.slot.seq, run.slot.tokens)
        if step is None or guess is None:
            return 1 / 3, (behind - 1) / 3
        return guess / step, max((self.draft.cost.seconds(behind) or guess) - guess, 0.0) / step

    def _verify(self, run: Running) -> None:
        """Sample at each drafted position, in order, with the sequence's own sampler: drafted
        tokens stay while they equal what was sampled; the cells after the first miss go."""
        assert run.slot is not None and run.drafted_by is not None
        draft, slot = run.draft, run.slot
        keep = len(slot.tokens) - len(draft)  # the next token's cell and everything before it
        accepted, status = 0, None
        for j, index in enumerate(run.draft_indices):
            token = self._sample(run, index)
            status = self._on_token(run, token)
            if status is not None or run.phase is Phase.PREFILLING:
                break  # ended, or a thinking budget closed the thoughts: the token is re-read with them
            if j < len(draft) and token == draft[j]:
                accepted += 1  # already in the cache, and its logits are the next to sample
                continue
            break  # a miss, or all kept and one more sampled: that token is the next to decode
        valid = slot.tokens[: keep + accepted]
        kept = self.kv.truncate(slot, len(valid))
        if kept < len(valid):  # memory that cannot drop part of a sequence: recompute what it lost
            self.prefill_now(slot, valid[kept:], media=run.prep.media)
        run.drafted_by.update(len(draft), accepted)
        run.draft, run.draft_indices, run.drafted_by = [], [], None
        if status is not None:
            self.finish(run, status)

    def _on_token(self, run: Running, token: int) -> RequestStatus | None:
        """One sampled token reaches the request: its text goes out; returns how the request
        ends if this token ends it, else None (the caller decides what goes into the cache)."""
        assert run.proc is not None
        be, req = self.runner, run.request
        run.clock.token()
        if be.is_eog(token) and not req.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        run.n_out += 1
        run.tokens_out.append(token)
        self._emit_text(run, run.proc.feed(be.piece(token), token))
        if run.proc.stopped:
            return RequestStatus.FINISHED_REPEATING if run.proc.repeating else RequestStatus.FINISHED_STOPPED
        if run.json is not None and self._close_json(run):
            return RequestStatus.FINISHED_LENGTH
        if req.max_tokens is not None and run.n_out >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if (req.line_time_limit is not None and b"\n" in be.piece(token)
                and run.clock.last_token - run.clock.first_token > req.line_time_limit):
            return RequestStatus.FINISHED_LENGTH
        if self.thinking.spent(req, run.proc):
            # the budget is spent: the engine writes the end of the thoughts itself, into the
            # sequence as if the model had, and the answer follows them
            for closing in self.thinking.closing:
                run.n_out += 1
                run.tokens_out.append(closing)
                self._emit_text(run, run.proc.feed(be.piece(closing), closing))
            # a token sampled before this one in the same verification is in the cache already
            run.pending, run.phase, run.next_token = [token, *self.thinking.closing], Phase.PREFILLING, -1
            if run.drafter is not None:
                run.drafter.extend(run.pending)
            return None
        if run.drafter is not None:
            run.drafter.extend([token])
        run.next_token, run.phase = token, Phase.DECODING
        return None

    def _close_json(self, run: Running) -> bool:
        """With a JSON Schema and max_tokens: once the tokens left come down to what the shortest
        valid end of the JSON so far takes, write that end (as the thinking budget writes the end
        of thoughts) and say the answer is over; the last token stays out of the cache, as at
        any length finish."""
        assert run.json is not None and run.proc is not None and run.request.max_tokens is not None
        left = run.request.max_tokens - run.n_out
        if left > JSON_CLOSE_WINDOW:
            return False
        text = run.proc.text
        run.json.feed(text[run.json_read :])
        run.json_read = len(text)
        if not run.json.valid or run.json.end is not None:
            run.json = None  # nothing to close: a complete value, or text the schema never made
            return False
        closing = run.json.closing()
        if closing != run.json_closing[0]:
            run.json_closing = (closing, self.runner.tokenize(closing, add_bos=False, special=False) if closing else [])
        tokens = run.json_closing[1]
        if run.json_step is None:
            steps = step_texts(run.json.root)
            run.json_step = max((len(self.runner.tokenize(t, add_bos=False, special=False)) for t in steps), default=1)
        # the end's length and what the next token may add to it: opening a key or an item
        # (an object whose required fields come with it) makes the end longer in one step
        if not tokens or left > len(tokens) + run.json_step + 2:
            return False
        for token in tokens:
            run.n_out += 1
            run.tokens_out.append(token)
            self._emit_text(run, run.proc.feed(self.runner.piece(token), token))
        return True

    def finish(self, run: Running, status: RequestStatus, error: str | None = None) -> None:
        """End a request: free what it holds first, then tell its client (whose callback may fail)."""
        self._dequeue(run)
        run.phase = Phase.FINISHED
        for future in run.encodes.values():
            future.cancel()
        run.encodes.clear()
        if run in self.active:
            self.active.remove(run)
        if run.sampler is not None:
            run.sampler.free()
            run.sampler = None
        slot = run.slot
        if slot is not None:
            self.kv.release(slot)
        tail = ""
        if run.proc is not None and status is not RequestStatus.FINISHED_ERROR:
            tail = run.proc.finish()
        self._emit_text(run, tail)
        run.handle.status = status
        metrics = run.clock.build(
            len(run.prep.tokens), run.cached, run.n_out, len(slot.tokens) if slot else 0, self.n_ctx
        )
        if run.restored is not None:
            metrics.prompt_cache_hit, metrics.restored_tokens = run.restored > 0, run.restored
        if run.proc is not None:
            metrics.reasoning_tokens = run.proc.reasoning_tokens
        policies = [p for p in (run.policy, run.model_policy) if p is not None]
        if policies:
            metrics.drafted_tokens = sum(p.drafted for p in policies)
            metrics.accepted_tokens = sum(p.accepted for p in policies)
        run.handle.emit(Metrics(metrics))
        text = run.proc.content if run.proc is not None else ""
        logprobs = run.logprobs[: run.n_out] if run.request.logprobs is not None else None
        run.handle.emit(Finished(FINISH_REASONS[status], text, metrics, error, run.tokens_out, logprobs,
                                 repeating=status is RequestStatus.FINISHED_REPEATING,
                                 reasoning=run.proc.reasoning if run.proc is not None else "",
                                 stop_sequence=run.proc.stop_found if run.proc is not None else None,
                                 tool_calls=list(run.proc.parser.calls) if run.proc is not None and run.proc.parser else []))

    def fail_running(self, exc: Exception) -> None:
        """A step failed (a bug, a llama.cpp error): its requests end with the error."""
        for run in list(self.active):
            self.finish(run, RequestStatus.FINISHED_ERROR, error=str(exc) or type(exc).__name__)
            # what llama.cpp holds after a failed decode is unknown: start that sequence afresh
            if run.slot is None:
                continue
            try:
                self.kv.clear(run.slot)
            except Exception:
                log.exception("could not clear sequence %d", run.slot.seq)

    def end_all(self, others: list[Running], error: str | None) -> None:
        """The engine is stopping: every request still here (and `others`, not yet queued) ends."""
        for run in list(self.active) + list(self.waiting) + others:
            run.handle.cancel()
            status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_CANCELLED
            self.finish(run, status, error=error)
        self.active.clear()
        self.waiting.clear()

    # ------------------------------------------------------------------ context full mid-answer
    def _make_room(self, run: Running) -> None:
        """The sequence is full: drop the oldest whole message(s), or failing that the older half
        of what follows the pinned prefix, then keep going. The stored conversation is untouched."""
        assert run.slot is not None
        slot, spans = run.slot, run.spans
        tokens = list(slot.tokens)
        need = max(self.n_ctx // 8, 1)
        dropped_msgs = 0
        if spans:
            a = b = spans[0][0]
            while spans and b - a < need:
                start, length = spans.pop(0)
                b = start + length
                dropped_msgs += 1
        else:
            a = run.prep.keep
            b = a + max((len(tokens) - a) // 2, 1)
            while b < len(tokens) and is_sentinel(tokens[b - 1]) and is_sentinel(tokens[b]):
                b += 1  # an image leaves whole
        n = b - a
        for span in spans:
            span[0] -= n
        policy = self.policy(run.request)
        if policy is ContextPolicy.TRUNCATE or not self.kv.drop(slot, a, b):
            # no position shift (by choice, or the memory or a busy sharer forbids it):
            # recompute what follows the cut at its new positions
            kept = self.kv.truncate(slot, a)
            self.prefill_now(slot, tokens[kept:a] + tokens[b:], media=run.prep.media)
        elif self.draft is not None:
            self.draft.drop(slot.seq, a, b)
        if dropped_msgs:
            note = f"{dropped_msgs} oldest message{'s' if dropped_msgs > 1 else ''} left the context"
            if run.request.session is not None:
                self.states.add_evicted(run.request.session, dropped_msgs)
        else:
            note = f"{n} older tokens left the context to make room for the answer"
        if policy is not ContextPolicy(run.request.context_policy):
            note += " (recomputed: this model's KV cache cannot shift positions)"
        run.handle.emit(Evicted(dropped_msgs, n, policy.value, note))

    def prefill_now(self, slot: Slot, tokens: list[int], logits_last: bool = False,
                    media: Mapping[int, MediaChunk] | None = None) -> int:
        """Decode tokens into the slot at once (outside the step's batch), the images among them
        (`media`: their chunks by first sentinel) encoded again here; returns the batch index of
        the last token's logits in the final chunk."""
        batch = self.runner.new_batch(self.runner.n_batch)
        idx = -1
        i = 0
        try:
            while i < len(tokens):
                if is_sentinel(tokens[i]):
                    chunk = (media or {}).get(tokens[i])
                    if chunk is None or self.projector is None:
                        raise ValueError("an image's cells must be recomputed, and its picture is not at hand")
                    self.projector.eval(chunk, slot.seq, slot.next_pos)
                    self.kv.extend(slot, tokens[i : i + chunk.n_tokens], chunk.n_pos)
                    i += chunk.n_tokens
                    continue
                batch.clear()
                chunk_tokens = tokens[i : i + _text_run(tokens[i:], self.runner.n_batch)]
                base = slot.next_pos
                for j, tok in enumerate(chunk_tokens):
                    last = logits_last and i + j == len(tokens) - 1
                    idx = batch.add(tok, base + j, slot.seq, last)
                self.kv.extend(slot, chunk_tokens)
                self.runner.decode(batch)
                i += len(chunk_tokens)
        finally:
            batch.close()
        return idx

    def continuation(self, n: int, session: str | None, tokens: list[int] | None) -> list[int]:
        """For consistency checks: n greedy tokens after a session's cached sequence (left as it
        was), or after `tokens` prefilled cold in an idle sequence."""
        if session is not None:
            slot = self.kv.slot_of(session)
            if slot is None or slot.busy or not slot.tokens:
                raise ValueError(f"no idle cached sequence for {session!r}")
            keep = len(slot.tokens)
            prefix = slot.tokens[-1:]
            self.kv.truncate(slot, keep - 1)  # its logits are gone: decode the last token again
        else:
            slot, keep, prefix = self._cold_slot(), 0, list(tokens or [])
        out: list[int] = []
        try:
            while len(out) < n:
                idx = self.prefill_now(slot, prefix, logits_last=True)
                prefix = [self.runner.argmax(idx)]
                out.append(prefix[0])
        finally:
            self.kv.truncate(slot, keep)
        return out

    def top_logits(self, tokens: list[int], n: int) -> list[tuple[int, float]]:
        """For checking near-ties: the n highest logits after `tokens`, prefilled cold."""
        slot = self._cold_slot()
        try:
            return self.runner.top_logits(self.prefill_now(slot, list(tokens), logits_last=True), n)
        finally:
            self.kv.clear(slot)

    def _cold_slot(self) -> Slot:
        """An idle sequence, emptied; a conversation's only if need be (spilled to its snapshot)."""
        slot = min((s for s in self.kv.slots if not s.busy), key=lambda s: s.session is not None, default=None)
        if slot is None:
            raise ValueError("no idle sequence to prefill into")
        self.kv.save_snapshot(slot)
        self.kv.forget(slot)
        return slot


def _frozen(logits: np.ndarray) -> np.ndarray:
    """A read-only copy: the view llama.cpp lends lasts only until the next decode."""
    kept = logits.copy()
    kept.flags.writeable = False
    return kept
