"""The engine: one thread owns the llama.cpp context and runs the scheduling loop.

Requests come in through a queue; each step decodes one token for every running sequence and a
chunk of every prompt still being prefilled, all in a single llama_decode (continuous batching);
results go back to each request's handle as events.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgechat.config import Paths, get_paths
from edgechat.engine import planner
from edgechat.engine.kvcache import (
    Slot,
    SnapshotStore,
    common_prefix,
    find_realign,
    model_fingerprint,
    state_version,
)
from edgechat.engine.llama import Batch, LlamaBackend
from edgechat.engine.metrics import RequestClock
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
from edgechat.engine.sampling import SamplerChain, validate
from edgechat.engine.stream import OutputProcessor
from edgechat.engine.templates import choose_format, validate_messages
from edgechat.errors import (
    EdgechatError,
    EngineBusyError,
    PromptTooLongError,
    UsageError,
)
from edgechat.models import display_name, read_model_info, resolve_model

log = logging.getLogger("edgechat.engine")

#: share of the context kept free for the answer when a request sets no max_tokens
ANSWER_RESERVE = 0.25
#: how a summary of evicted messages is introduced to the model
SUMMARY_PREFIX = "Summary of the earlier conversation: "
#: prompt tokens prefilled per step while other sequences are decoding (chunked prefill):
#: one llama.cpp ubatch, so a long prompt never stalls the running streams for more than that
PREFILL_CHUNK_BUSY = 512
#: new tokens from which llama.cpp's CPU flash attention takes its tiled path (GGML_FA_TILE_Q)
ALIGNED_PREFILL_MIN = 64
#: an idle engine writes changed conversations' snapshots after this many seconds
IDLE_SNAPSHOT_S = 30.0
#: after idling, wait this long for requests sent together, so they are prefilled together
BATCH_WINDOW_S = 0.003


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
class _Prepared:
    tokens: list[int]
    keep: int  # tokens of the pinned prefix (never evicted)
    spans: list[list[int]]  # [start, length] of each evictable message, oldest first
    evicted_total: int  # messages of the conversation left out of the prompt
    evicted_now: int  # of which newly left out by this request
    summary: str | None = None  # what the model wrote of them (summarize policy)


@dataclass
class _Active:
    handle: RequestHandle
    request: ChatRequest
    prep: _Prepared
    clock: RequestClock
    slot: Slot | None = None
    sampler: SamplerChain | None = None
    proc: OutputProcessor | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    next_token: int | None = None  # sampled, not yet in the KV cache
    out_index: int = -1  # batch index whose logits this request samples from
    n_out: int = 0
    cached: int = 0
    tokens_out: list[int] = field(default_factory=list)


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
        self.slots = [Slot(seq=i) for i in range(self.n_slots)]
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: deque[_Active] = deque()
        self._active: list[_Active] = []
        self._lock = threading.Lock()
        self._n_waiting = 0
        self._sessions: dict[str, dict] = {}  # session -> {"evicted": int, "summary": str}
        self._seg_cache: dict[str, tuple[list[dict], list[str]]] = {}  # session -> rendered messages
        self._snapshots: SnapshotStore | None = None
        self._batch = Batch(be.n_batch, self.n_slots)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="edgechat-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public API (any thread)
    def submit(self, request: ChatRequest, on_event=None) -> RequestHandle:
        if self._closed:
            raise UsageError("the engine is closed")
        clock = RequestClock()
        prep = self._prepare(request)
        clock.tokenize = time.perf_counter() - clock.submitted
        handle = RequestHandle(request, on_event)
        with self._lock:
            # requests that a free sequence will take at the next step are not queued
            free = max(self.config.n_parallel - len(self._active), 0)
            if self.config.max_queue is not None and self._n_waiting - free >= self.config.max_queue:
                raise EngineBusyError(f"the engine is busy ({self._n_waiting - free} requests waiting); try again shortly")
            self._n_waiting += 1
        self._inbox.put(_Active(handle, request, prep, clock))
        return handle

    def prompt_tokens(self, request: ChatRequest) -> list[int]:
        """The exact tokens the model would be given for this request (template applied)."""
        return list(self._prepare(request, check_limit=False).tokens)

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
        }

    def release_session(self, session: str, wait: bool = True) -> None:
        """The conversation went idle: snapshot its sequence to disk (it stays hot while room allows)."""
        done = threading.Event()
        self._inbox.put(("release", session, done))
        if wait:
            done.wait()

    def forget_session(self, session: str) -> None:
        """The conversation was deleted: drop its sequence and snapshot."""
        done = threading.Event()
        self._inbox.put(("forget", session, done))
        done.wait()

    def seq_positions(self, session: str) -> tuple[int, int, int] | None:
        """(pos_min, pos_max, mirrored length) of a session's sequence, for consistency checks."""
        result: list = []
        done = threading.Event()
        self._inbox.put(("positions", session, (result, done)))
        done.wait()
        return result[0] if result else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        done = threading.Event()
        self._inbox.put(("close", None, done))
        done.wait(timeout=60)
        self._thread.join(timeout=5)
        self._batch.close()
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- prompt preparation
    def _is_special_token(self, text: str) -> bool:
        toks = self.backend.tokenize(text, add_bos=False, special=True)
        return len(toks) == 1 and self.backend.is_control(toks[0])

    def _tokens_for(self, segments: list[str]) -> list[list[int]]:
        be = self.backend
        out = [be.tokenize(s, add_bos=False, special=True) for s in segments]
        if be.add_bos and (not out[0] or out[0][0] != be.bos):
            out[0] = [be.bos] + out[0]
        return out

    def _limit(self, request: ChatRequest) -> int:
        share = int(self.n_ctx * ANSWER_RESERVE)
        reserve = min(request.max_tokens, share) if request.max_tokens else share
        return self.n_ctx - reserve

    def _prepare(self, request: ChatRequest, check_limit: bool = True) -> _Prepared:
        validate(request.sampling)
        if request.max_tokens is not None and request.max_tokens < 1:
            raise UsageError(f"max_tokens must be at least 1 (got {request.max_tokens})")
        if request.ignore_eos and request.max_tokens is None:
            raise UsageError("ignore_eos needs max_tokens, or the answer would never end (add --max-tokens N)")
        limit = self._limit(request)
        if request.messages is None:
            text = request.prompt or ""
            if not text.strip():
                raise UsageError("the prompt is empty; type a message")
            tokens = self._tokens_for([text])[0]
            prep = _Prepared(tokens, 0, [], 0, 0)
        else:
            prep = self._prepare_chat(request, limit)
        if check_limit and len(prep.tokens) > limit:
            raise PromptTooLongError(
                f"the prompt is {len(prep.tokens)} tokens but this context allows {limit} "
                f"({self.n_ctx} minus {self.n_ctx - limit} kept for the answer); shorten it, "
                f"lower max_tokens or raise the context with --ctx",
                len(prep.tokens),
                limit,
            )
        return prep

    def _prepare_chat(self, request: ChatRequest, limit: int) -> _Prepared:
        msgs = validate_messages(request.messages)
        # the pinned prefix: leading system messages and leading pinned ones
        keep_msgs = 0
        while keep_msgs < len(msgs) - 1 and (msgs[keep_msgs]["role"] == "system" or keep_msgs in request.pinned):
            keep_msgs += 1
        state = self._session_state(request.session) if request.session else {}
        already = min(state.get("evicted", 0), max(len(msgs) - 1 - keep_msgs, 0))
        summary = state.get("summary") if already else None
        policy = self._policy(request)
        retained, seg_tokens, pinned, evicted = self._fit(request, msgs, keep_msgs, already, summary, limit)
        if evicted > already and policy is not ContextPolicy.SHIFT:
            # truncate and summarize recompute what follows the cut: cut deeper, so that happens rarely
            retained, seg_tokens, pinned, evicted = self._fit(request, msgs, keep_msgs, already, summary, limit // 2)
        if evicted > already and policy is ContextPolicy.SUMMARIZE:
            # the model condenses what leaves the context; the summary stays pinned in its place
            summary = self._summarize(summary, msgs[keep_msgs + already : keep_msgs + evicted])
            retained, seg_tokens, pinned, evicted = self._fit(request, msgs, keep_msgs, evicted, summary, limit)
        tokens: list[int] = []
        spans: list[list[int]] = []
        keep = 0
        segmented = len(seg_tokens) > 1  # one span per message, then the generation prompt
        for i, st in enumerate(seg_tokens):
            if segmented and pinned <= i < len(retained) - 1:
                spans.append([len(tokens), len(st)])
            tokens += st
            if segmented and i < pinned:
                keep = len(tokens)
        return _Prepared(tokens, keep, spans, evicted, evicted - already, summary)

    def _fit(self, request, msgs, keep_msgs, evicted, summary, limit):
        """Leave out the oldest unpinned messages (sessions only) until the prompt fits."""
        extra = [{"role": "system", "content": f"{SUMMARY_PREFIX}{summary}"}] if summary else []
        if request.session is not None:
            evicted = max(evicted, self._estimate_eviction(msgs, keep_msgs, limit))
        while True:
            retained = msgs[:keep_msgs] + extra + msgs[keep_msgs + evicted :]
            segs = self._segments(retained, request.session)
            seg_tokens = self._tokens_for(segs)
            total = sum(len(t) for t in seg_tokens)
            can_evict = request.session is not None and keep_msgs + evicted < len(msgs) - 1
            if total <= limit or not can_evict or len(segs) == 1:
                return retained, seg_tokens, keep_msgs + len(extra), evicted
            # drop as many of the oldest unpinned messages as cover the excess, in one go
            excess, first = total - limit, keep_msgs + len(extra)
            for st in seg_tokens[first : len(retained) - 1]:
                evicted += 1
                excess -= len(st)
                if excess <= 0:
                    break
            evicted = min(evicted, len(msgs) - 1 - keep_msgs)

    def _estimate_eviction(self, msgs: list[dict], keep_msgs: int, limit: int) -> int:
        """A cheap lower bound on how many old messages must go, so a long history is not
        re-rendered once per evicted message (each message counted alone plus a small framing)."""
        if len(msgs) < 32:
            return 0
        budget = limit - sum(len(self.tokenize(m["content"])) + self._framing for m in msgs[:keep_msgs])
        used = 0
        for i in range(len(msgs) - 1, keep_msgs - 1, -1):
            used += len(self.tokenize(msgs[i]["content"])) + self._framing
            if used > budget:
                return max(i + 1 - keep_msgs, 0)
        return 0

    @functools.cached_property
    def _framing(self) -> int:
        """Tokens the template adds around one message's content (role markers, separators)."""
        probe = [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        segs = self._segments(probe, None)
        if len(segs) != len(probe) + 1:
            return 0
        return max(len(self._tokens_for([segs[1]])[0]) - len(self.tokenize("x")), 0)

    def _segments(self, retained: list[dict], session: str | None) -> list[str]:
        """Template segments, reusing those of the conversation's earlier turns (a long chat
        renders only its new messages)."""
        if self.format.mode == "completion":
            return ["\n\n".join(m["content"] for m in retained)]
        cached = self._seg_cache.get(session) if session else None
        known = _reusable_segments(retained, *cached) if cached else None
        segs = self.format.segments(retained, known)
        if session and len(segs) == len(retained) + 1:
            self._seg_cache.pop(session, None)
            self._seg_cache[session] = (retained, segs[:-1])
            while len(self._seg_cache) > 64:
                self._seg_cache.pop(next(iter(self._seg_cache)))
        return segs

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
            text = self.submit(request).result().text.strip()
        except EdgechatError as exc:
            log.warning("could not summarize evicted messages (%s); they are dropped instead", exc)
            return previous
        return text or previous

    def _session_state(self, session: str) -> dict:
        with self._lock:
            if session in self._sessions:
                return dict(self._sessions[session])
        # a conversation from an earlier run: its eviction state travels in its snapshot
        return self._snapshot_store().peek_state(session) or {}

    # ---------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        while True:
            try:
                block = not self._active and not self._waiting
                item = self._inbox.get(timeout=IDLE_SNAPSHOT_S) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:  # idle for a while: put the conversations that changed on disk
                    for slot in self.slots:
                        self._save_snapshot(slot)
                item = None
            if item is not None:
                if isinstance(item, _Active):
                    self._waiting.append(item)
                    if block and self.config.n_parallel > 1:
                        time.sleep(BATCH_WINDOW_S)
                elif self._command(*item):
                    return
                continue  # drain the inbox before the next step
            try:
                self._admit()
                if self._active:
                    self._step()
            except Exception as exc:  # a bug or a llama.cpp failure: fail the requests, keep serving
                log.exception("engine step failed")
                for act in list(self._active):
                    self._finish(act, RequestStatus.FINISHED_ERROR, error=str(exc))
                    if act.slot is not None:
                        self.backend.seq_rm(act.slot.seq)
                        act.slot.tokens = []

    def _command(self, name: str, session, done) -> bool:
        if name == "close":
            for act in list(self._active) + list(self._waiting):
                act.handle.cancel()
                self._finish(act, RequestStatus.FINISHED_CANCELLED)
            self._waiting.clear()
            for slot in self.slots:
                if slot.session and slot.tokens:
                    self._save_snapshot(slot)
            done.set()
            return True
        if name == "positions":
            result, ev = done
            slot = self._slot_of(session)
            if slot is not None:
                lo, hi = self.backend.seq_pos_range(slot.seq)
                result.append((lo, hi, len(slot.tokens)))
            ev.set()
            return False
        slot = self._slot_of(session)
        if name == "release" and slot is not None and not slot.busy and slot.tokens:
            self._save_snapshot(slot)
        elif name == "forget":
            if slot is not None and not slot.busy:
                self.backend.seq_rm(slot.seq)
                slot.tokens, slot.session = [], None
            self._snapshot_store().delete(session)
            with self._lock:
                self._sessions.pop(session, None)
        done.set()
        return False

    def _slot_of(self, session: str | None) -> Slot | None:
        if session is None:
            return None
        return next((s for s in self.slots if s.session == session), None)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        still: deque[_Active] = deque()
        while self._waiting:
            act = self._waiting.popleft()
            if act.handle.cancelled:
                with self._lock:
                    self._n_waiting -= 1
                self._finish(act, RequestStatus.FINISHED_CANCELLED)
                continue
            if len(self._active) >= self.config.n_parallel:
                still.append(act)
                continue
            slot = self._pick_slot(act)
            if slot is None:
                still.append(act)
                continue
            with self._lock:
                self._n_waiting -= 1
            self._start(act, slot)
        self._waiting = still

    def _pick_slot(self, act: _Active) -> Slot | None:
        session = act.request.session
        own = self._slot_of(session)
        if own is not None:
            return None if own.busy else own
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None
        prompt = act.prep.tokens
        # prefer slots nobody's conversation lives in, then the one sharing the longest prefix, then LRU
        free.sort(key=lambda s: (s.session is not None, -common_prefix(s.tokens, prompt), s.last_used))
        slot = free[0]
        if slot.session is not None:
            self._save_snapshot(slot)  # spill the least recently used conversation to disk
        if session is not None and self._restore_snapshot(slot, session):
            return slot
        slot.session = session
        # another sequence may already hold a longer prefix (a shared system prompt): share its cells
        mine = common_prefix(slot.tokens, prompt)
        donor = max(self.slots, key=lambda s: common_prefix(s.tokens, prompt))
        theirs = common_prefix(donor.tokens, prompt)
        if donor is not slot and theirs > mine:
            self.backend.seq_rm(slot.seq)
            self.backend.seq_cp(donor.seq, slot.seq, 0, theirs)
            slot.tokens = donor.tokens[:theirs]
        return slot

    def _start(self, act: _Active, slot: Slot) -> None:
        be, req, prompt = self.backend, act.request, act.prep.tokens
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
        cache = slot.tokens
        n = common_prefix(cache, prompt)
        if n < len(cache):
            if req.session is not None and self._policy(req) is ContextPolicy.SHIFT:
                b, m = find_realign(cache, prompt, n)
                if m:
                    # whole messages left the prompt: shift the tokens after them down, no recompute
                    be.seq_rm(slot.seq, n, b)
                    be.seq_add(slot.seq, b, -1, -(b - n))
                    cache = cache[:n] + cache[b:]
                    n = common_prefix(cache, prompt)
            be.seq_rm(slot.seq, n, -1)
            cache = cache[:n]
        if n and len(prompt) - n >= ALIGNED_PREFILL_MIN and n * 32 <= len(prompt) - n:
            # a cached prefix this short (a BOS, a one-line system prompt) saves under 1/32 of the
            # batch, while a batch that starts at position 0 runs llama.cpp's tiled attention in
            # step with the causal diagonal: Gemma 3, 512 tokens from 0 take 4% less time than
            # 511 after a cached BOS
            be.seq_rm(slot.seq, 0, -1)
            cache, n = [], 0
        if n == len(prompt):
            # everything is cached, but the logits are not: recompute the last prompt token
            n -= 1
            be.seq_rm(slot.seq, n, -1)
            cache = cache[:n]
        slot.tokens = cache
        act.cached = n
        act.pending = prompt[n:]
        act.sampler = SamplerChain(req.sampling, be.n_vocab)
        act.sampler.accept_prompt(prompt)
        act.proc = OutputProcessor(req.stop)

    def _policy(self, req: ChatRequest) -> ContextPolicy:
        policy = ContextPolicy(req.context_policy)
        if policy is ContextPolicy.SHIFT and not self.backend.can_shift:
            if not self._shift_warned:
                log.warning("this model's KV cache cannot shift positions; falling back to 'truncate'")
                self._shift_warned = True
            return ContextPolicy.TRUNCATE
        return policy

    # ------------------------------------------------------------------ one step
    def _step(self) -> None:
        be, batch = self.backend, self._batch
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
            act.slot.tokens.append(act.next_token)
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
            act.slot.tokens.extend(chunk)
            if not act.pending:
                act.out_index = idx
                sampling.append(act)
        if batch.n == 0:
            return
        be.decode(batch)
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
        if act in self._active:
            self._active.remove(act)
        tail = act.proc.finish() if act.proc is not None and status is not RequestStatus.FINISHED_ERROR else ""
        if tail:
            act.handle.emit(TextDelta(tail))
        if act.sampler is not None:
            act.sampler.free()
            act.sampler = None
        slot = act.slot
        if slot is not None:
            slot.busy = False
            slot.last_used = time.monotonic()
            slot.dirty = slot.session is not None
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
        be, slot, prep = self.backend, act.slot, act.prep
        tokens = slot.tokens
        need = max(self.n_ctx // 8, 1)
        a = b = None
        dropped_msgs = 0
        if prep.spans:
            a = prep.spans[0][0]
            b = a
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
        if policy is ContextPolicy.TRUNCATE:
            # no position shift: recompute what follows the cut at its new positions
            rest = tokens[b:]
            be.seq_rm(slot.seq, a, -1)
            slot.tokens = tokens[:a]
            self._prefill_now(slot, rest)
        else:
            be.seq_rm(slot.seq, a, b)
            be.seq_add(slot.seq, b, -1, -n)
            slot.tokens = tokens[:a] + tokens[b:]
        if dropped_msgs:
            note = f"{dropped_msgs} oldest message{'s' if dropped_msgs > 1 else ''} left the context"
            if act.request.session is not None:
                with self._lock:
                    self._sessions.setdefault(act.request.session, {})["evicted"] = (
                        self._sessions.get(act.request.session, {}).get("evicted", 0) + dropped_msgs
                    )
        else:
            note = f"{n} older tokens left the context to make room for the answer"
        act.handle.emit(Evicted(dropped_msgs, n, policy.value, note))

    def _prefill_now(self, slot: Slot, tokens: list[int]) -> None:
        batch = Batch(self.backend.n_batch, self.n_slots)
        try:
            for i in range(0, len(tokens), self.backend.n_batch):
                batch.clear()
                for tok in tokens[i : i + self.backend.n_batch]:
                    batch.add(tok, len(slot.tokens), slot.seq, False)
                    slot.tokens.append(tok)
                self.backend.decode(batch)
        finally:
            batch.close()

    # ------------------------------------------------------------------ snapshots
    def _snapshot_store(self) -> SnapshotStore:
        if self._snapshots is None:
            tags = {
                "model_sha256": model_fingerprint(self.model_path, self.paths.cache),
                "n_ctx": self.n_ctx,
                "kv_type": self.config.kv_type,
                "state_version": state_version(),
            }
            self._snapshots = SnapshotStore(self.paths.snapshots, tags, self.config.snapshot_budget)
        return self._snapshots

    def _save_snapshot(self, slot: Slot) -> None:
        if not slot.dirty or not slot.session or not slot.tokens:
            return
        slot.dirty = False
        with self._lock:
            state = dict(self._sessions.get(slot.session, {}))
        try:
            data = self.backend.state_seq_get(slot.seq)
            self._snapshot_store().save(slot.session, slot.tokens, state, data)
        except OSError as exc:
            log.warning("could not save the KV snapshot of %s: %s", slot.session, exc)

    def _restore_snapshot(self, slot: Slot, session: str) -> bool:
        snap = self._snapshot_store().load(session)
        self.backend.seq_rm(slot.seq)
        slot.tokens, slot.session = [], session
        if snap is None or len(snap.tokens) > self.n_ctx:
            return False
        if not self.backend.state_seq_set(slot.seq, snap.data):
            self.backend.seq_rm(slot.seq)
            return False
        slot.tokens = snap.tokens
        with self._lock:
            self._sessions.setdefault(session, {}).update(snap.session_state)
        return True


def _reusable_segments(retained: list[dict], old_msgs: list[dict], old_segs: list[str]) -> list[str] | None:
    """Segments of the last turn that still apply: the same leading (pinned) messages, then the
    old messages from wherever the new history resumes them (old ones may have been evicted).
    ChatFormat.segments() checks the result against a full render, so a wrong guess costs time only."""
    p = 0
    while p < min(len(retained), len(old_msgs)) and retained[p] == old_msgs[p]:
        p += 1
    if p == len(old_msgs) or p == len(retained):
        return old_segs[:p]
    try:
        j = old_msgs.index(retained[p], p + 1)
    except ValueError:
        return old_segs[:p]
    n = 0
    while j + n < len(old_msgs) and p + n < len(retained) and old_msgs[j + n] == retained[p + n]:
        n += 1
    return old_segs[:p] + old_segs[j : j + n]

