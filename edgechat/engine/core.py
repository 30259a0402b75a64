"""The engine: one thread owns the llama.cpp context and runs the scheduling loop.

Requests come in through a queue; each step decodes one token for every running sequence and a
chunk of every prompt still being prefilled, all in a single llama_decode (continuous batching);
results go back to each request's handle as events. Prompts are prepared on the caller's thread
(engine/prompt.py); every KV cache operation goes through the KV manager (engine/kvcache.py).

Nothing a request, a callback or the disk does may leave a client waiting: every request gets a
Finished event, every command an answer within a bound, and a dead thread refuses new work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgechat.config import Paths, get_paths, make_data_dir
from edgechat.engine import planner
from edgechat.engine.kvcache import KVManager, Slot
from edgechat.engine.llama import Batch, LlamaBackend
from edgechat.engine.metrics import RequestClock
from edgechat.engine.prompt import Prepared, PromptBuilder
from edgechat.engine.request import (
    FINISH_REASONS,
    ChatRequest,
    ContextPolicy,
    Evicted,
    Finished,
    Metrics,
    RequestHandle,
    RequestStatus,
    SamplingParams,
    TextDelta,
)
from edgechat.engine.sampling import SamplerChain
from edgechat.engine.snapshots import SnapshotStore, model_fingerprint, state_version
from edgechat.engine.stream import OutputProcessor
from edgechat.engine.templates import choose_format
from edgechat.errors import EdgechatError, EngineBusyError, EngineStoppedError, UsageError
from edgechat.models import display_name, read_model_info, resolve_model

log = logging.getLogger("edgechat.engine")

#: prompt tokens prefilled per step while other sequences are decoding (chunked prefill):
#: one llama.cpp ubatch, so a long prompt never stalls the running streams for more than that
PREFILL_CHUNK_BUSY = 512
#: an idle engine writes changed conversations' snapshots after this many seconds
IDLE_SNAPSHOT_S = 30.0
#: after idling, wait this long for requests sent together, so they are prefilled together
BATCH_WINDOW_S = 0.003
#: how long a caller waits for the engine thread to answer a command (a snapshot write included)
COMMAND_TIMEOUT_S = 60.0


@dataclass
class EngineConfig:
    model: str | None = None
    n_ctx: int | None = None  # per sequence; None = planner's choice
    n_threads: int | None = None
    n_parallel: int = 1  # requests decoded together
    hot_sessions: int = 0  # extra sequences that keep idle conversations in memory
    kv_type: str = "f16"
    #: llama.cpp's flash attention: "auto" (on for CPU) is fastest for short contexts; on this
    #: 2-core CPU "off" answers sooner deep into long chats (see docs/ARCHITECTURE.md)
    flash_attn: str = "auto"
    max_queue: int | None = None
    n_gpu_layers: int | None = None
    snapshot_budget: int = 4 << 30
    paths: Paths | None = None
    #: called from the loading thread with the fraction of the model read (0..1)
    on_load_progress: Callable[[float], None] | None = None


@dataclass
class _Active:
    handle: RequestHandle
    request: ChatRequest
    prep: Prepared
    clock: RequestClock
    queued: bool = True  # counted in Engine._n_waiting
    slot: Slot | None = None
    sampler: SamplerChain | None = None
    proc: OutputProcessor | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    next_token: int | None = None  # sampled, not yet in the KV cache
    out_index: int = -1  # batch index whose logits this request samples from
    n_out: int = 0
    cached: int = 0
    tokens_out: list[int] = field(default_factory=list)


@dataclass
class _Command:
    """Work for the engine thread that answers its caller (a snapshot, a check, closing)."""

    name: str
    arg: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class Engine:
    """See edgechat/engine/__init__.py for the public contract."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        self.paths = cfg.paths or get_paths()
        if cfg.n_parallel < 1:
            raise UsageError("--parallel must be at least 1")
        if cfg.flash_attn not in ("auto", "on", "off"):
            raise UsageError(f"flash attention must be auto, on or off (got {cfg.flash_attn!r})")
        self.model_path: Path = resolve_model(cfg.model, self.paths)
        self.model_info = info = read_model_info(self.model_path)
        self.n_slots = cfg.n_parallel + cfg.hot_sessions
        plan = planner.choose_context(info, cfg.n_ctx, self.n_slots, cfg.kv_type)
        self.plan = plan
        self.n_ctx = plan.n_ctx
        self.n_threads = cfg.n_threads or planner.physical_cores()
        self.backend = LlamaBackend(
            self.model_path,
            n_ctx_total=self.n_ctx * self.n_slots,
            n_seq_max=self.n_slots,
            n_threads=self.n_threads,
            kv_type=cfg.kv_type,
            n_gpu_layers=cfg.n_gpu_layers,
            flash_attn=cfg.flash_attn,
            on_progress=cfg.on_load_progress,
        )
        be = self.backend
        self.model_name = display_name(cfg.model, self.model_path)
        self.format = choose_format(
            be.meta("tokenizer.chat_template"),
            info.architecture,
            be.token_text(be.bos) if be.bos >= 0 else "",
            be.token_text(be.eos) if be.eos >= 0 else "",
            self._is_special_token,
        )
        self.template_mode = self.format.mode
        self.template_warning = self.format.warning
        self._shift_warned = False
        self._lock = threading.Lock()
        self._sessions: dict[str, dict] = {}  # session -> {"evicted": int, "summary": str}
        self._snapshots: SnapshotStore | None = None
        self.kv = KVManager(be, self.n_slots, self._snapshot_store, self._saved_state, self._restored_state)
        self.prompts = PromptBuilder(
            self.format,
            lambda text: be.tokenize(text, add_bos=False, special=True),
            be.bos if be.add_bos else None,
            self.n_ctx,
            self._session_state,
            self._summarize,
        )
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[_Active] = deque()
        self._active: list[_Active] = []
        self._n_waiting = 0
        self._decode_calls = 0  # llama_decode calls of the step loop: batching shows as fewer calls
        self._batch = Batch(be.n_batch, self.n_slots)
        self._closed = False
        self._stopped: str | None = None  # why the thread ended, once it has
        self._thread = threading.Thread(target=self._run, name="edgechat-engine", daemon=True)
        self._thread.start()

    @property
    def slots(self) -> list[Slot]:
        return self.kv.slots

    # ---------------------------------------------------------------- public API (any thread)
    def submit(self, request: ChatRequest, on_event=None, prepared: Prepared | None = None) -> RequestHandle:
        """Queue a request. `prepared` is what prepare() built for it (its max_tokens may have
        been lowered since): the prompt is then not built twice."""
        self._check_running()
        clock = RequestClock()
        if prepared is None:
            prep = self.prompts.prepare(request, self._policy(request))
        else:
            prep = prepared
            self.prompts.check(request, prep)
        clock.tokenize = time.perf_counter() - clock.submitted
        handle = RequestHandle(request, on_event)
        with self._lock:
            # checked again under the lock the dying thread takes: nothing is queued into nothing
            self._check_running()
            # requests that a free sequence will take at the next step are not queued
            free = max(self.config.n_parallel - len(self._active), 0)
            if self.config.max_queue is not None and self._n_waiting - free >= self.config.max_queue:
                raise EngineBusyError(f"the engine is busy ({self._n_waiting - free} requests waiting); try again shortly")
            self._n_waiting += 1
            self._inbox.put(_Active(handle, request, prep, clock))
        return handle

    def prepare(self, request: ChatRequest) -> Prepared:
        """The prompt submit() would build for this request (template, tokens, eviction), without
        the limit check; front ends that look at it first hand it to submit()."""
        return self.prompts.prepare(request, self._policy(request), check_limit=False)

    def prompt_tokens(self, request: ChatRequest) -> list[int]:
        """The exact tokens the model would be given for this request (template applied)."""
        return list(self.prepare(request).tokens)

    def count_tokens(self, request: ChatRequest) -> int:
        return len(self.prompt_tokens(request))

    def tokenize(self, text: str) -> list[int]:
        return self.backend.tokenize(text, add_bos=False, special=False)

    def detokenize(self, tokens: list[int]) -> str:
        return self.backend.detokenize(tokens)

    def stats(self) -> dict:
        running = list(self._active)  # a copy: the engine thread changes the list
        used = sum(len(a.slot.tokens) for a in running if a.slot is not None)
        cached = sum(len(s.tokens) for s in self.slots) - used
        return {
            "running": len(running),
            "waiting": self._n_waiting,
            "kv_used": used,
            "kv_cached": max(cached, 0),
            "kv_total": self.n_ctx * self.n_slots,
            "n_parallel": self.config.n_parallel,
            "decode_calls": self._decode_calls,
        }

    @property
    def alive(self) -> bool:
        return self._stopped is None and self._thread.is_alive()

    def release_session(self, session: str, wait: bool = True) -> None:
        """The conversation went idle: snapshot its sequence to disk (it stays hot while room allows)."""
        self._call("release", session, wait)

    def forget_session(self, session: str) -> None:
        """The conversation was deleted: drop its sequence and snapshot."""
        self._call("forget", session)

    def seq_positions(self, session: str) -> tuple[int, int, int] | None:
        """(pos_min, pos_max, mirrored length) of a session's sequence, for consistency checks."""
        return self._call("positions", session)

    def kv_problems(self) -> list[str]:
        """Every way the KV mirrors disagree with llama.cpp's cells (empty when consistent)."""
        return self._call("check")

    def greedy_continuation(self, n: int, session: str | None = None, tokens: list[int] | None = None) -> list[int]:
        """For consistency checks: the n tokens greedy decoding appends to a session's cached
        sequence (which is left as it was), or to `tokens` prefilled cold in an idle slot."""
        return self._call("continue", (n, session, tokens))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._inbox.put(_Command("close"))
            self._thread.join(timeout=COMMAND_TIMEOUT_S)
        if self._thread.is_alive():
            # the thread is inside llama.cpp: freeing the model under it would crash the process
            log.warning("the engine thread did not stop; leaving its model loaded")
            return
        self._batch.close()
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_running(self) -> None:
        if self._closed:
            raise EngineStoppedError("the engine is closed; load the model again")
        if self._stopped is not None or not self._thread.is_alive():
            raise EngineStoppedError(f"the engine stopped ({self._stopped or 'its thread ended'}); restart edgechat")

    def _call(self, name: str, arg=None, wait: bool = True):
        """Run a command on the engine thread; raise rather than wait forever."""
        self._check_running()
        cmd = _Command(name, arg)
        self._inbox.put(cmd)
        if not wait:
            return None
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not cmd.done.wait(0.1):
            if not self._thread.is_alive():
                raise EngineStoppedError(f"the engine stopped ({self._stopped or 'its thread ended'}); restart edgechat")
            if time.monotonic() > deadline:
                raise EngineStoppedError(f"the engine did not answer within {COMMAND_TIMEOUT_S:.0f} s; restart edgechat")
        if cmd.error is not None:
            raise cmd.error
        return cmd.result

    # ---------------------------------------------------------------- prompt preparation support
    def _is_special_token(self, text: str) -> bool:
        toks = self.backend.tokenize(text, add_bos=False, special=True)
        return len(toks) == 1 and self.backend.is_control(toks[0])

    def _summarize(self, previous: str | None, leaving: list[dict]) -> str | None:
        lines = [f"Earlier summary: {previous}"] if previous else []
        lines += [f"{m['role']}: {m['content']}" for m in leaving]
        transcript = "\n".join(lines)[-self.n_ctx :]  # characters, a safe bound on tokens
        request = ChatRequest(
            messages=[{"role": "user", "content": f"Summarize this conversation in two or three sentences, keeping names and facts:\n\n{transcript}"}],
            sampling=SamplingParams(temperature=0),
            max_tokens=min(128, self.n_ctx // 8),
        )
        try:
            done = self.submit(request).result(timeout=COMMAND_TIMEOUT_S)
        except (EdgechatError, TimeoutError) as exc:
            log.warning("could not summarize evicted messages (%s); they are dropped instead", exc)
            return previous
        return done.text.strip() or previous

    def _session_state(self, session: str) -> dict:
        with self._lock:
            if session in self._sessions:
                return dict(self._sessions[session])
        # a conversation from an earlier run: its eviction state travels in its snapshot
        return self._snapshot_store().peek_state(session) or {}

    def _saved_state(self, session: str) -> dict:
        with self._lock:
            return dict(self._sessions.get(session, {}))

    def _restored_state(self, session: str, state: dict) -> None:
        with self._lock:
            self._sessions.setdefault(session, {}).update(state)

    def _policy(self, req: ChatRequest) -> ContextPolicy:
        policy = ContextPolicy(req.context_policy)
        if policy is ContextPolicy.SHIFT and not self.backend.can_shift:
            if not self._shift_warned:
                log.warning("this model's KV cache cannot shift positions; falling back to 'truncate'")
                self._shift_warned = True
            return ContextPolicy.TRUNCATE
        return policy

    # ---------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        reason = "closed"
        try:
            while True:
                block = not self._active and not self._waiting
                try:
                    item = self._inbox.get(timeout=IDLE_SNAPSHOT_S) if block else self._inbox.get_nowait()
                except queue.Empty:
                    item = None
                try:
                    if isinstance(item, _Active):
                        self._waiting.append(item)
                        if block and self.config.n_parallel > 1:
                            time.sleep(BATCH_WINDOW_S)
                    elif isinstance(item, _Command):
                        if self._command(item):
                            return
                    elif block:  # idle for a while: put the conversations that changed on disk
                        for slot in self.slots:
                            self.kv.save_snapshot(slot)
                    else:
                        self._admit()
                        if self._active:
                            self._step()
                except Exception as exc:  # a bug or a llama.cpp failure: fail the running requests, keep serving
                    log.exception("engine step failed")
                    self._fail_running(exc)
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.exception("the engine thread died")
            raise
        finally:
            self._shut_down(reason)

    def _fail_running(self, exc: Exception) -> None:
        for act in list(self._active):
            self._finish(act, RequestStatus.FINISHED_ERROR, error=str(exc) or type(exc).__name__)
            # what llama.cpp holds after a failed decode is unknown: start that sequence afresh
            try:
                self.kv.clear(act.slot)
            except Exception:
                log.exception("could not clear sequence %d", act.slot.seq)

    def _shut_down(self, reason: str) -> None:
        """The thread is ending: whatever was asked of it gets an answer, and nothing more comes in."""
        with self._lock:
            self._stopped = reason
        pending = list(self._active) + list(self._waiting)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Active):
                pending.append(item)
            else:
                item.error = EngineStoppedError(f"the engine stopped ({reason}); restart edgechat")
                item.done.set()
        error = None if reason == "closed" else f"the engine stopped ({reason})"
        for act in pending:
            act.handle.cancel()
            self._finish(act, RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_CANCELLED, error=error)
        self._active.clear()
        self._waiting.clear()

    def _command(self, cmd: _Command) -> bool:
        """Run one command; True when the engine is to stop. Its caller always gets an answer."""
        try:
            if cmd.name == "close":
                for slot in self.slots:
                    self.kv.save_snapshot(slot)
                return True
            slot = self.kv.slot_of(cmd.arg) if isinstance(cmd.arg, str) else None
            if cmd.name == "positions":
                cmd.result = self.kv.positions(slot) if slot is not None else None
            elif cmd.name == "check":
                cmd.result = self.kv.check()
            elif cmd.name == "continue":
                cmd.result = self._continuation(*cmd.arg)
            elif cmd.name == "release":
                if slot is not None and not slot.busy:
                    self.kv.save_snapshot(slot)
            elif cmd.name == "forget":
                if slot is not None and not slot.busy:
                    self.kv.forget(slot)
                self._snapshot_store().delete(cmd.arg)
                with self._lock:
                    self._sessions.pop(cmd.arg, None)
            else:
                raise ValueError(f"unknown engine command {cmd.name!r}")
        except Exception as exc:
            log.exception("engine command %s failed", cmd.name)
            cmd.error = exc
        finally:
            cmd.done.set()
        return False

    # ------------------------------------------------------------------ admission
    def _dequeue(self, act: _Active) -> None:
        if act.queued:
            act.queued = False
            with self._lock:
                self._n_waiting -= 1

    def _admit(self) -> None:
        still: deque[_Active] = deque()
        while self._waiting:
            act = self._waiting.popleft()
            try:
                if act.handle.cancelled:
                    self._finish(act, RequestStatus.FINISHED_CANCELLED)
                    continue
                slot = None
                if len(self._active) < self.config.n_parallel:
                    slot = self.kv.pick(act.request.session, act.prep.tokens, self.n_ctx)
                if slot is None:
                    still.append(act)
                    continue
                self._dequeue(act)
                self._start(act, slot)
            except Exception as exc:  # this request cannot start (a snapshot it needs, a bug): it alone fails
                log.exception("could not start a request")
                self._finish(act, RequestStatus.FINISHED_ERROR, error=str(exc) or type(exc).__name__)
        self._waiting = still

    def _start(self, act: _Active, slot: Slot) -> None:
        req, prompt = act.request, act.prep.tokens
        act.slot, slot.busy = slot, True
        act.clock.admitted = time.perf_counter()
        act.handle.status = RequestStatus.RUNNING
        self._active.append(act)
        if req.session is not None:
            with self._lock:
                state = self._sessions.setdefault(req.session, {})
                state["evicted"] = act.prep.evicted_total
                if act.prep.summary:
                    state["summary"] = act.prep.summary
        if act.prep.evicted_now:
            n = act.prep.evicted_now
            act.handle.emit(Evicted(n, 0, self._policy(req).value, f"{n} oldest message{'s' if n > 1 else ''} left the context"))
        realign = req.session is not None and self._policy(req) is ContextPolicy.SHIFT
        act.cached = self.kv.reuse(slot, prompt, realign)
        act.pending = prompt[act.cached :]
        act.sampler = SamplerChain(req.sampling, self.backend.n_vocab)
        act.sampler.accept_prompt(prompt)
        act.proc = OutputProcessor(req.stop)

    # ------------------------------------------------------------------ one step
    def _step(self) -> None:
        be, batch, kv = self.backend, self._batch, self.kv
        batch.clear()
        sampling: list[_Active] = []
        for act in list(self._active):
            if act.handle.cancelled:
                self._finish(act, RequestStatus.FINISHED_CANCELLED)
                continue
            if act.next_token is None:
                continue
            if len(act.slot.tokens) >= self.n_ctx:
                self._make_room(act)
            act.out_index = batch.add(act.next_token, len(act.slot.tokens), act.slot.seq, True)
            kv.extend(act.slot, [act.next_token])
            act.next_token = None
            sampling.append(act)
        busy = bool(sampling)
        for act in self._active:
            if not act.pending or batch.free == 0:
                continue
            room = min(batch.free, PREFILL_CHUNK_BUSY if busy else batch.free)
            chunk, act.pending = act.pending[:room], act.pending[room:]
            base = len(act.slot.tokens)
            for i, tok in enumerate(chunk):
                last = not act.pending and i == len(chunk) - 1
                idx = batch.add(tok, base + i, act.slot.seq, last)
            kv.extend(act.slot, chunk)
            if not act.pending:
                act.out_index = idx
                sampling.append(act)
        if batch.n == 0:
            return
        be.decode(batch)
        self._decode_calls += 1
        for act in sampling:
            smp = act.sampler
            self._on_token(act, be.argmax(act.out_index) if smp.plain_greedy else be.sample(smp.chain, act.out_index))

    def _on_token(self, act: _Active, token: int) -> None:
        be, req = self.backend, act.request
        act.clock.token()
        if be.is_eog(token) and not req.ignore_eos:
            self._finish(act, RequestStatus.FINISHED_STOPPED)
            return
        act.n_out += 1
        act.tokens_out.append(token)
        text = act.proc.feed(be.piece(token))
        if text:
            act.handle.emit(TextDelta(text))
        if act.proc.stopped:
            self._finish(act, RequestStatus.FINISHED_STOPPED)
        elif req.max_tokens is not None and act.n_out >= req.max_tokens:
            self._finish(act, RequestStatus.FINISHED_LENGTH)
        else:
            act.next_token = token

    def _finish(self, act: _Active, status: RequestStatus, error: str | None = None) -> None:
        """End a request: free what it holds first, then tell its client (whose callback may fail)."""
        self._dequeue(act)
        if act in self._active:
            self._active.remove(act)
        if act.sampler is not None:
            act.sampler.free()
            act.sampler = None
        slot = act.slot
        if slot is not None:
            self.kv.release(slot)
            slot.dirty = slot.session is not None
        tail = ""
        if act.proc is not None and status is not RequestStatus.FINISHED_ERROR:
            tail = act.proc.finish()
        if tail:
            act.handle.emit(TextDelta(tail))
        act.handle.status = status
        metrics = act.clock.build(
            len(act.prep.tokens), act.cached, act.n_out, len(slot.tokens) if slot else 0, self.n_ctx
        )
        act.handle.emit(Metrics(metrics))
        text = act.proc.text if act.proc is not None else ""
        act.handle.emit(Finished(FINISH_REASONS[status], text, metrics, error, act.tokens_out))

    # ------------------------------------------------------------------ context full mid-answer
    def _make_room(self, act: _Active) -> None:
        """The sequence is full: drop the oldest whole message(s), or failing that the older half
        of what follows the pinned prefix, then keep going. The stored conversation is untouched."""
        slot, prep = act.slot, act.prep
        tokens = list(slot.tokens)
        need = max(self.n_ctx // 8, 1)
        dropped_msgs = 0
        if prep.spans:
            a = b = prep.spans[0][0]
            while prep.spans and b - a < need:
                start, length = prep.spans.pop(0)
                b = start + length
                dropped_msgs += 1
        else:
            a = prep.keep
            b = a + max((len(tokens) - a) // 2, 1)
        n = b - a
        for span in prep.spans:
            span[0] -= n
        policy = self._policy(act.request)
        if policy is ContextPolicy.TRUNCATE or not self.kv.drop(slot, a, b):
            # no position shift (by choice, or the memory or a busy sharer forbids it):
            # recompute what follows the cut at its new positions
            kept = self.kv.truncate(slot, a)
            self._prefill_now(slot, tokens[kept:a] + tokens[b:])
        if dropped_msgs:
            note = f"{dropped_msgs} oldest message{'s' if dropped_msgs > 1 else ''} left the context"
            if act.request.session is not None:
                with self._lock:
                    state = self._sessions.setdefault(act.request.session, {})
                    state["evicted"] = state.get("evicted", 0) + dropped_msgs
        else:
            note = f"{n} older tokens left the context to make room for the answer"
        act.handle.emit(Evicted(dropped_msgs, n, policy.value, note))

    def _prefill_now(self, slot: Slot, tokens: list[int], logits_last: bool = False) -> int:
        """Decode tokens into the slot at once (outside the step's batch); returns the batch
        index of the last token's logits in the final chunk."""
        batch = Batch(self.backend.n_batch, self.n_slots)
        idx = -1
        try:
            for i in range(0, len(tokens), self.backend.n_batch):
                batch.clear()
                chunk = tokens[i : i + self.backend.n_batch]
                for j, tok in enumerate(chunk):
                    last = logits_last and i + j == len(tokens) - 1
                    idx = batch.add(tok, len(slot.tokens) + j, slot.seq, last)
                self.kv.extend(slot, chunk)
                self.backend.decode(batch)
        finally:
            batch.close()
        return idx

    def _continuation(self, n: int, session: str | None, tokens: list[int] | None) -> list[int]:
        if session is not None:
            slot = self.kv.slot_of(session)
            if slot is None or slot.busy or not slot.tokens:
                raise ValueError(f"no idle cached sequence for {session!r}")
            keep = len(slot.tokens)
            prefix = slot.tokens[-1:]
            self.kv.truncate(slot, keep - 1)  # its logits are gone: decode the last token again
        else:
            # an idle sequence, a conversation's only if need be (it is spilled to its snapshot)
            slot = min((s for s in self.slots if not s.busy), key=lambda s: s.session is not None, default=None)
            if slot is None:
                raise ValueError("no idle sequence to prefill into")
            self.kv.save_snapshot(slot)
            self.kv.forget(slot)
            keep, prefix = 0, list(tokens)
        out: list[int] = []
        try:
            while len(out) < n:
                idx = self._prefill_now(slot, prefix, logits_last=True)
                prefix = [self.backend.argmax(idx)]
                out.append(prefix[0])
        finally:
            self.kv.truncate(slot, keep)
        return out

    # ------------------------------------------------------------------ snapshots
    def _snapshot_store(self) -> SnapshotStore:
        if self._snapshots is None:
            try:
                make_data_dir(self.paths)  # private (0700) before the first snapshot lands there
            except OSError as exc:
                log.warning("cannot create %s (%s); conversations will not be snapshotted", self.paths.snapshots, exc)
            tags = {
                "model_sha256": model_fingerprint(self.model_path, self.paths.cache),
                "n_ctx": self.n_ctx,
                "kv_type": self.config.kv_type,
                "state_version": state_version(),
            }
            self._snapshots = SnapshotStore(self.paths.snapshots, tags, self.config.snapshot_budget)
        return self._snapshots
