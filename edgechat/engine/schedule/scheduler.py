"""The scheduler: which requests run, and one step of them all.

Runs on the engine thread only. Waiting requests are admitted when a sequence is free (the KV
manager picks it and reuses what it can); each step decodes one token for every running
sequence and a chunk of every prompt still being prefilled, all in one llama_decode (continuous
batching); sampled tokens go to each request's answer (engine/output/answer.py), which says
whether they end it. Drafts come from the speculator (speculator.py), images from the encoder
thread (encoder.py). Every request ends in `finish`, which frees what it holds before its
client hears of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from edgechat.engine.kv.kvcache import MIN_FILL_REALIGN, KVManager, Slot, is_sentinel
from edgechat.engine.kv.sessions import ConversationStates
from edgechat.engine.output.answer import Usage
from edgechat.engine.output.reasoning import ChannelFormat, ReasoningFormat, Thinking
from edgechat.engine.output.toolfamilies import GENERIC, ToolFamily
from edgechat.engine.runners.runner import ModelRunner
from edgechat.engine.runners.sampling import SamplerChain
from edgechat.engine.schedule.draft import DraftModel
from edgechat.engine.schedule.encoder import ImageEncoder
from edgechat.engine.schedule.prefill import Prefiller, text_run
from edgechat.engine.schedule.running import MediaStep, Phase, Running, StepPlan
from edgechat.engine.schedule.speculator import Speculator
from edgechat.engine.types.request import ChatRequest, ContextPolicy, Evicted, RequestStatus
from edgechat.errors import EngineBusyError
from edgechat.params import SpeculativeMode

if TYPE_CHECKING:
    from edgechat.engine.runners.media import Projector

log = logging.getLogger("edgechat.engine")

#: prompt tokens prefilled per step while other sequences are decoding (chunked prefill), by
#: default: one llama.cpp ubatch, so a long prompt never stalls the running streams for more
#: than that (EngineConfig.prefill_chunk; bench/bench_traffic.py measures the trade)
PREFILL_CHUNK_BUSY = 512


class Scheduler:
    """Plans each step (`schedule`), has the model runner run it, applies the result
    (`update`): admission, chunked prefill, the verification of drafts, the freeing of every
    request. The KV manager alone changes the cache; each request's answer alone makes its text."""

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
        prefill_chunk: int = PREFILL_CHUNK_BUSY,
    ):
        self.runner = runner
        self.prefill_chunk = prefill_chunk
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
        #: drafts and what they cost, for the requests that speculate
        self.speculator = Speculator(kv, n_ctx, draft, prefill_chunk)
        self.waiting: deque[Running] = deque()
        self.active: list[Running] = []
        #: requests submitted and not yet started or ended (read by any thread)
        self.n_waiting = 0
        self._count_lock = threading.Lock()
        #: llama_decode calls of the step loop: batching shows as fewer calls than tokens
        self.decode_calls = 0
        self._batch = runner.new_batch(runner.n_batch)
        self.projector = projector
        self._encoder = ImageEncoder(projector, wake) if projector is not None else None
        self.prefill = Prefiller(runner, kv, projector)

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.close()
        self._batch.close()

    @property
    def encoding(self) -> bool:
        """A running request waits for an image's encode (the engine thread may sleep until it ends)."""
        return ImageEncoder.waiting(self.active)

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
        req, prompt, answer = run.request, run.prep.tokens, run.answer
        run.slot = slot
        self.kv.occupy(slot)
        answer.clock.admitted = time.perf_counter()
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
            answer.cached = self.kv.reuse(slot, prompt, True, MIN_FILL_REALIGN)
        else:
            answer.cached = self.kv.reuse(slot, prompt, req.session is not None and self.policy(req) is ContextPolicy.SHIFT)
        answer.restored = slot.cache_restored if slot.cache_restored is None else min(slot.cache_restored, answer.cached)
        run.pending = prompt[answer.cached :]
        run.phase = Phase.PREFILLING if run.pending else Phase.SAMPLING
        if run.prep.media:
            assert self._encoder is not None  # the prompt builder refuses images otherwise
            self._encoder.start(run)
        run.sampler = SamplerChain(req.sampling, self.runner.n_vocab, self.runner.vocab, req.grammar)
        run.sampler.accept_prompt([t for t in prompt if not is_sentinel(t)] if run.prep.media else prompt)
        answer.open(run.prep, self.runner, self.thinking, self.tool_family)
        run.guesses = self.speculator.guesses(run, self.speculative(req))
        if answer.cached == len(prompt):
            # the whole prompt is cached with the logits after it (KVManager.reuse): the first
            # token is chosen now, and the next step decodes it with the others
            self.speculator.prompt_read(run)
            assert slot.next_logits is not None  # reuse counts the whole prompt only with its logits
            status = self._on_token(run, self._sample(run, kept=slot.next_logits.values))
            if status is not None:
                self.finish(run, status)

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
            self.speculator.cost.observe(plan.batch.n, time.perf_counter() - started)
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
            self.speculator.add_drafts(batch, plan.decoding, self.active)
        for run in list(self.active):
            if run.phase is not Phase.PREFILLING or batch.free == 0:
                continue
            assert run.slot is not None
            room = min(batch.free, self.prefill_chunk if plan.decoding else batch.free)
            if is_sentinel(run.pending[0]):
                if plan.media is not None or not self._plan_image(run, plan):
                    continue  # one image a step, or its encode is still running
                assert plan.media is not None  # _plan_image planned it
                if plan.decoding:  # an image costs what a prefill chunk of its cells does
                    room = max(room - plan.media.chunk.n_tokens, 0)
                if not room or is_sentinel(run.pending[0]):
                    continue
            room = text_run(run.pending, room)
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
        try:
            embeddings = ImageEncoder.take(run)
        except Exception as exc:  # the projector failed on this picture: its request alone ends
            log.exception("could not encode an image")
            self.finish(run, RequestStatus.FINISHED_ERROR, error=str(exc) or type(exc).__name__)
            return False
        if embeddings is None:
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
            self.speculator.prompt_read(run)
        for run in plan.decoding + plan.prompted:
            if run.guesses is not None and run.guesses.draft:
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
            run.answer.record_logprob(be.logits(index) if kept is None else kept, token)
        return token

    def _verify(self, run: Running) -> None:
        """Sample at each drafted position, in order, with the sequence's own sampler: drafted
        tokens stay while they equal what was sampled; the cells after the first miss go."""
        guesses, slot = run.guesses, run.slot
        assert guesses is not None and slot is not None
        draft = guesses.draft
        keep = len(slot.tokens) - len(draft)  # the next token's cell and everything before it
        accepted, status = 0, None
        for j, index in enumerate(guesses.indices):
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
            self.prefill.now(slot, valid[kept:], media=run.prep.media)
        guesses.settle(accepted)
        if status is not None:
            self.finish(run, status)

    def _on_token(self, run: Running, token: int) -> RequestStatus | None:
        """One sampled token reaches the request's answer; returns how the request ends if this
        token ends it, else None, the token (with what the engine wrote after it) on its way
        into the cache."""
        fed = run.answer.feed(token)
        if fed.ended is not None:
            return fed.ended
        if fed.inject is not None:
            # a token sampled before this one in the same verification is in the cache already
            run.pending, run.phase, run.next_token = [token, *fed.inject], Phase.PREFILLING, -1
        else:
            run.next_token, run.phase = token, Phase.DECODING
        if run.guesses is not None:
            run.guesses.extend(run.pending if fed.inject is not None else [token])
        return None

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
        drafts = run.guesses.counts if run.guesses is not None else None
        run.answer.finish(status, error, Usage(len(run.prep.tokens), len(slot.tokens) if slot else 0, self.n_ctx, drafts))

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
            self.prefill.now(slot, tokens[kept:a] + tokens[b:], media=run.prep.media)
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

def _frozen(logits: np.ndarray) -> np.ndarray:
    """A read-only copy: the view llama.cpp lends lasts only until the next decode."""
    kept = logits.copy()
    kept.flags.writeable = False
    return kept
