"""The engine: one thread owns the llama.cpp context and runs the scheduling loop.

Requests are prepared on the caller's thread (engine/prompt/prompt.py) and come in through a queue; the
thread runs the scheduler (engine/schedule/scheduler.py: admission, one llama_decode per step for every
running sequence), and every KV cache operation goes through the KV manager (engine/kv/kvcache.py).

Nothing a request, a callback or the disk does may leave a client waiting: every request gets a
Finished event, every command an answer within a bound, and a dead thread refuses new work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgechat.config import Paths, get_paths, make_data_dir
from edgechat.engine.embeddings import Embedder, EmbeddingJob
from edgechat.engine.kv.kvcache import KVManager, Slot
from edgechat.engine.kv.promptcache import PromptCache
from edgechat.engine.kv.sessions import ConversationStates
from edgechat.engine.kv.snapshots import PromptStore, SnapshotStore, model_fingerprint
from edgechat.engine.prompt.fim import InfillBuilder
from edgechat.engine.prompt.prompt import Prepared, PromptBuilder, PromptQueries
from edgechat.engine.prompt.templates import choose_format
from edgechat.engine.runners import devices
from edgechat.engine.runners.llama import LlamaBackend, state_version
from edgechat.engine.runners.media import Projector
from edgechat.engine.runners.sampling import grammar_parses
from edgechat.engine.schedule.draft import DraftModel, DraftVocabError
from edgechat.engine.schedule.scheduler import Running, Scheduler
from edgechat.engine.types.metrics import RequestClock
from edgechat.engine.types.request import ChatRequest, ContextPolicy, RequestHandle
from edgechat.errors import EdgechatError, EngineStoppedError, UsageError
from edgechat.models import catalog_draft, display_name, find_projector, planner, read_model_info, resolve_model
from edgechat.params import CHOICES, FlashAttn, Grammar, KVType, SamplingParams, SpeculativeMode, SwaCache, choice

if TYPE_CHECKING:
    from edgechat.engine.runners.onnxrt import OnnxPlacement

log = logging.getLogger("edgechat.engine")

#: an idle engine writes changed conversations' snapshots after this many seconds
IDLE_SNAPSHOT_S = 30.0
#: with the prompt cache on disk, a sequence idle this long has its state written there
PROMPT_IDLE_S = 1.0
#: after idling, wait this long for requests sent together, so they are prefilled together
BATCH_WINDOW_S = 0.003
#: how long a caller waits for the engine thread to answer a command (a snapshot write included)
COMMAND_TIMEOUT_S = 60.0


#: longest sleep of an engine thread whose requests all wait for image encodes (each encode's end
#: wakes it at once; this bounds a lost wake-up)
ENCODE_POLL_S = 0.5


@dataclass
class EngineConfig:
    model: str | None = None
    n_ctx: int | None = None  # per sequence; None = planner's choice
    #: the most the planner's choice may be (None: the model's trained window, where memory
    #: allows: `serve`, whose agents send prompts of 10-20k tokens); a chat starts faster capped
    ctx_cap: int | None = planner.DEFAULT_CTX_CAP
    n_threads: int | None = None
    n_parallel: int = 1  # requests decoded together
    hot_sessions: int = 0  # extra sequences that keep idle conversations in memory
    kv_type: KVType = KVType.F16
    #: llama.cpp's flash attention: "auto" (on for CPU) is fastest for short contexts; on this
    #: 2-core CPU "off" answers sooner deep into long chats (see docs/ARCHITECTURE.md)
    flash_attn: FlashAttn = FlashAttn.AUTO
    #: sliding-window models (Gemma 3): "full" cache, "small" (the window only: less memory, no
    #: shifting, so conversations truncate), or "auto" (small only where full does not fit)
    swa_cache: SwaCache = SwaCache.AUTO
    max_queue: int | None = None
    #: "auto" (as many layers as the GPUs' free memory holds), "all" or a count; None: "auto"
    #: (front ends put a model's gpu_layers from config.toml here, models/settings.py). No effect
    #: on a CPU-only build.
    n_gpu_layers: int | str | None = None
    #: llama.cpp RPC servers ("host:port") whose devices take layers like local GPUs
    rpc_servers: list[str] = field(default_factory=list)
    snapshot_budget: int = 4 << 30
    #: bytes of host RAM for the states of recent prompts beyond the slots (engine/kv/promptcache.py);
    #: 0 = off. Off by default here: conversations have their own snapshots; `serve` turns it on
    prompt_cache_budget: int = 0
    paths: Paths | None = None
    #: speculative decoding by default: "auto" (n-gram lookup, and the draft model if any,
    #: where they pay), "off", "lookup", "draft"
    speculative: SpeculativeMode = SpeculativeMode.AUTO
    #: a smaller model of the same vocabulary that guesses tokens for the model to verify
    draft_model: str | None = None
    #: the model's projector (an mmproj GGUF) that lets it read images (engine/runners/media.py); None:
    #: an mmproj*.gguf beside its file, or the one `edgechat pull` fetched with it, if any
    mmproj: str | None = None
    #: a GGUF that computes embeddings (engine/embeddings.py) instead of the model itself
    embedding_model: str | None = None
    #: the same text for the same prompt, seed and settings whatever else the engine serves or
    #: holds: one sequence at a time, each prompt prefilled from position 0 of an empty cache, no
    #: prompt cache, no speculative decoding (llama.cpp's kernels round differently in other
    #: batch shapes, which decides near-ties). Costs batching, prefix reuse and speculation
    deterministic: bool = False
    #: a Jinja chat template used instead of the GGUF's own (as llama-server's --chat-template-file;
    #: front ends put a model's chat_template from config.toml here, models/settings.py)
    chat_template: str | None = None
    ep: str | None = None  # an ONNX folder's onnxruntime execution provider (engine/runners/onnxrt.py)
    #: called from the loading thread with the fraction of the model read (0..1)
    on_load_progress: Callable[[float], None] | None = None
    #: bytes of disk for the prompt cache's states (`serve --cache-disk`; 0 = off): written in the
    #: background while serving (a crash loses the last seconds), with the idle sequences' at
    #: close(), and found again by the next engine on this model, tags permitting: a restarted
    #: server, or a model the pool unloaded (engine/pool.py), resumes its clients' prompts
    #: without prefilling them
    prompt_cache_disk: int = 0

    def __post_init__(self):
        # the enums' words from any caller; a wrong one is one line naming the others
        for name in ("kv_type", "flash_attn", "swa_cache", "speculative"):
            setattr(self, name, choice(CHOICES[name], getattr(self, name), name))


@dataclass
class _Command:
    """Work for the engine thread that answers its caller (a snapshot, a check, closing)."""

    name: str
    arg: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class Engine(PromptQueries):
    """See edgechat/engine/__init__.py for the public contract."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        self.paths = cfg.paths or get_paths()
        if cfg.n_parallel < 1:
            raise UsageError("--parallel must be at least 1")
        # a verification batch is another shape than one token's step
        self.speculative_default = SpeculativeMode.OFF if cfg.deterministic else cfg.speculative
        #: the draft model asked for, or the one the catalog names for this model if it is here
        self.draft_ref = None if cfg.deterministic else cfg.draft_model
        if self.draft_ref is None and self.speculative_default is not SpeculativeMode.OFF:
            self.draft_ref = catalog_draft(cfg.model, self.paths)
        self._check_draft(self.speculative_default)
        self.model_path: Path = resolve_model(cfg.model, self.paths)
        self.model_name = display_name(cfg.model, self.model_path)
        self.n_threads = cfg.n_threads or planner.default_threads()
        self.n_slots = cfg.n_parallel + cfg.hot_sessions
        self.onnx = self.model_path.is_dir()
        if self.onnx:
            self._open_onnx()
        else:
            self._open_gguf()
        info, be = self.model_info, self.backend
        #: what a request's sampling starts from: the model's recommended settings where its file
        #: has them, else SamplingParams' own defaults (front ends lay the user's choices on top)
        self.default_sampling = SamplingParams(**info.sampling)
        self.format = choose_format(
            cfg.chat_template or be.meta("tokenizer.chat_template"),
            be.meta("general.architecture") or info.architecture,
            be.token_text(be.bos) if be.bos >= 0 else "",
            be.token_text(be.eos) if be.eos >= 0 else "",
            self._is_special_token,
        )
        self.template_mode = self.format.mode
        self.template_warning = self.format.warning
        self._shift_warned = False
        self._lock = threading.Lock()
        self.states = ConversationStates()
        self._snapshots: SnapshotStore | None = None
        # a restored state's cells were computed in other batches than a fresh prefill's
        budget = 0 if cfg.deterministic else cfg.prompt_cache_budget
        self.prompt_cache = PromptCache(budget, lambda: self._snapshot_store().tags)
        self._kept_idle: dict[int, float] = {}  # seq -> the idle spell (last_used) whose state was kept
        self.kv = KVManager(
            be, self.n_slots, self._snapshot_store, self._saved_state, self._restored_state, self.prompt_cache,
            mrope=self.projector is not None and self.projector.mrope,
        )
        if self.prompt_cache.enabled and cfg.prompt_cache_disk > 0:
            try:
                self.prompt_cache.attach(self._prompt_store())
            except OSError as exc:  # a read-only or full disk: the cache serves from RAM alone
                log.warning("the prompt cache stays in RAM: cannot use %s (%s)", self.paths.snapshots / "prompts", exc)
        if self.onnx:
            self.draft, self.draft_warning, self.embedder = None, None, None
        else:
            self.draft, self.draft_warning = self._load_draft()
            self.embedder = self._load_embedder()
        self.scheduler = Scheduler(
            be, self.kv, self.states, self.n_ctx, 1 if cfg.deterministic else cfg.n_parallel, self._policy, self._speculative,
            self.draft, deterministic=cfg.deterministic, reasoning=self.format.reasoning,
            projector=self.projector, wake=lambda: self._inbox.put(None), tool_family=self.format.tool_family,
        )
        self.prompts = PromptBuilder(
            self.format,
            lambda text: be.tokenize(text, add_bos=False, special=True),
            be.bos if be.add_bos else None,
            self.n_ctx,
            self._session_state,
            self._summarize,
            self.projector,
            self.model_name,
            InfillBuilder(be.fim_tokens(), lambda text: be.tokenize(text, add_bos=False, special=False),
                          lambda text: be.tokenize(text, add_bos=False, special=True),
                          be.bos if be.add_bos else None, be.n_batch, self.model_name),
            be.n_vocab,
        )
        self._inbox: queue.Queue = queue.Queue()
        self._closed = False
        self._stopped: str | None = None  # why the thread ended, once it has
        self._thread = threading.Thread(target=self._run, name="edgechat-engine", daemon=True)
        self._thread.start()

    def _open_gguf(self) -> None:
        """A GGUF file through llama.cpp: the memory plan, the GPU split and the context."""
        cfg = self.config
        self.model_info = info = read_model_info(self.model_path)
        # found before the plan: its weights count there, and a wrong file fails before loading
        mmproj = find_projector(cfg.mmproj, self.model_path, cfg.model, self.paths)
        plan = planner.choose_context(info, cfg.n_ctx, self.n_slots, cfg.kv_type, swa=cfg.swa_cache, label=self.model_name,
                                      projector=planner.projector_bytes(mmproj), flash_attn=cfg.flash_attn, cap=cfg.ctx_cap)
        self.plan, self.n_ctx = plan, plan.n_ctx
        if cfg.rpc_servers:
            devices.add_rpc_servers(cfg.rpc_servers)
        self.gpu: planner.GpuSplit | OnnxPlacement = planner.gpu_split(info, plan, cfg.n_gpu_layers, devices.gpu_devices())
        self.backend = be = LlamaBackend(
            self.model_path,
            n_ctx_total=self.n_ctx * self.n_slots,
            n_seq_max=self.n_slots,
            n_threads=self.n_threads,
            kv_type=cfg.kv_type,
            n_gpu_layers=self.gpu.n_gpu_layers,
            flash_attn=cfg.flash_attn,
            swa_full=plan.swa_full,
            on_progress=cfg.on_load_progress,
        )
        self.projector = None
        if mmproj is None:
            return
        try:
            projector = Projector(be, mmproj)
        except BaseException:
            be.close()
            raise
        self.projector = projector

    def _open_onnx(self) -> None:
        """An ONNX folder through onnxruntime (engine/runners/onnxrt.py): its own KV buffers, one row
        per sequence; no draft model, no embeddings (they need llama.cpp's context)."""
        from edgechat.engine.runners.onnxrt import OnnxPlacement, OnnxRunner
        from edgechat.models.onnxinfo import read_onnx_info

        cfg = self.config
        if cfg.draft_model is not None:
            raise UsageError("a draft model needs a GGUF model; ONNX folders use n-gram speculation only")
        if cfg.mmproj is not None:
            raise UsageError("a projector (--mmproj) needs a GGUF model; ONNX folders read text only")
        self.projector = None
        self.draft_ref = None
        self.model_info = info = read_onnx_info(self.model_path)
        self.plan = planner.choose_context(info, cfg.n_ctx, self.n_slots, label=self.model_name, cap=cfg.ctx_cap)
        self.n_ctx = self.plan.n_ctx
        runner = OnnxRunner(self.model_path, self.n_ctx, self.n_slots, self.n_threads, cfg.ep)
        self.gpu = OnnxPlacement(runner.session.get_providers())
        # typed as a GGUF engine's: its LlamaBackend-only paths (draft, projector, embeddings) are closed to ONNX
        self.backend = runner  # type: ignore[assignment]

    @property
    def modalities(self) -> tuple[str, ...]:
        """What the model reads besides text: ("vision",), ("vision", "audio") or () (its projector's)."""
        return self.projector.modalities if self.projector is not None else ()

    @property
    def slots(self) -> list[Slot]:
        return self.kv.slots

    # ---------------------------------------------------------------- public API (any thread)
    def submit(self, request: ChatRequest, on_event=None, prepared: Prepared | None = None) -> RequestHandle:
        """Queue a request. `prepared` is what prepare() built for it (its max_tokens may have
        been lowered since): the prompt is then not built twice."""
        self._check_running()
        self._check_draft(request.speculative)
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
            self.scheduler.reserve(self.config.max_queue)
            self._inbox.put(Running(handle, request, prep, clock))
        return handle

    def embed(self, inputs: list[str | list[int]], truncate: bool = False, on_done=None) -> EmbeddingJob:
        """Queue texts or token arrays for embedding (engine/embeddings.py); bad inputs raise
        EmbeddingInputError here. `on_done(job)` is called on the engine thread at its end."""
        self._check_running()
        if self.embedder is None:
            raise UsageError("embeddings need a GGUF model; ONNX folders do not compute them")
        job = EmbeddingJob(self.embedder.prepare(inputs, truncate), on_done)
        with self._lock:
            self._check_running()
            self._inbox.put(job)
        return job

    def rerank(self, query: str, documents: list[str], truncate: bool = False, on_done=None) -> EmbeddingJob:
        """Queue a reranker's scores of each document for `query` (its vectors: one score per
        label), as `embed` queues vectors; a model that is not a reranker raises UsageError."""
        self._check_running()
        if self.embedder is None:
            raise UsageError("reranking needs a GGUF model; ONNX folders do not compute it")
        job = EmbeddingJob(self.embedder.prepare_rerank(query, documents, truncate), on_done)
        with self._lock:
            self._check_running()
            self._inbox.put(job)
        return job

    def tokenize(self, text: str) -> list[int]:
        return self.backend.tokenize(text, add_bos=False, special=False)

    def grammar_parses(self, grammar: Grammar) -> bool:
        return grammar_parses(self.backend.vocab, grammar)

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """The tokens' text; with `special`, control tokens written out (a prompt as llama-server
        reports it)."""
        # llama.cpp aborts the process on an id outside the vocabulary
        if any(not 0 <= t < self.backend.n_vocab for t in tokens):
            raise UsageError(f"token ids must be between 0 and {self.backend.n_vocab - 1}")
        return self.backend.detokenize(tokens, special)

    def stats(self) -> dict:
        running = list(self.scheduler.active)  # a copy: the engine thread changes the list
        used = sum(len(a.slot.tokens) for a in running if a.slot is not None)
        cached = sum(len(s.tokens) for s in self.slots) - used
        return {
            "running": len(running),
            "waiting": self.scheduler.n_waiting,
            "kv_used": used,
            "kv_cached": max(cached, 0),
            "kv_total": self.n_ctx * self.n_slots,
            "n_parallel": self.config.n_parallel,
            "decode_calls": self.scheduler.decode_calls,
            "prompt_cache_bytes": self.prompt_cache.bytes,
            "prompt_cache_entries": len(self.prompt_cache),
        }

    def release_session(self, session: str, wait: bool = True) -> None:
        """The conversation went idle: snapshot its sequence to disk (it stays hot while room allows)."""
        self._call("release", session, wait)

    def forget_session(self, session: str) -> None:
        """The conversation was deleted: drop its sequence and snapshot."""
        self._call("forget", session)

    def seq_positions(self, session: str) -> tuple[int, int, int] | None:
        """(pos_min, pos_max, mirrored length) of a session's sequence, for consistency checks."""
        return self._call("positions", session)

    def shed_prompt_cache(self) -> int:
        """Memory is short: the prompt cache lets go of its states in RAM (those on disk stay
        and are read back when asked). The bytes let go."""
        return self._call("shed_cache")

    def kv_problems(self) -> list[str]:
        """Every way the KV mirrors disagree with llama.cpp's cells (empty when consistent)."""
        return self._call("check")

    def greedy_continuation(self, n: int, session: str | None = None, tokens: list[int] | None = None) -> list[int]:
        """For consistency checks: the n tokens greedy decoding appends to a session's cached
        sequence (which is left as it was), or to `tokens` prefilled cold in an idle slot."""
        return self._call("continue", (n, session, tokens))

    def top_logits(self, tokens: list[int], n: int = 2) -> list[tuple[int, float]]:
        """For checking near-ties: the n highest (token, logit) after `tokens`, prefilled cold."""
        return self._call("top_logits", (tokens, n))

    @property
    def stopped(self) -> str | None:
        """Why the engine thread ended without being closed (a bug, a llama.cpp failure); None
        while it runs."""
        if self._closed:
            return None
        return self._stopped or (None if self._thread.is_alive() else "its thread ended")

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
        self.scheduler.close()
        if self.draft is not None:
            self.draft.close()
        if self.embedder is not None:
            self.embedder.close()
            if self.embedder.backend is not self.backend:
                self.embedder.backend.close()
        if self.projector is not None:
            self.projector.close()
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
        state = self.states.get(session)
        if state is not None:
            return state
        # a conversation from an earlier run: its eviction state travels in its snapshot
        return self._snapshot_store().peek_state(session) or {}

    def _saved_state(self, session: str) -> dict:
        return self.states.get(session) or {}

    def _load_draft(self) -> tuple[DraftModel | None, str | None]:
        """The draft model, if one is configured: a wrong vocabulary is refused (a choice to
        correct), a file that does not load leaves the model serving without it, and says so."""
        if self.draft_ref is None:
            return None, None
        try:
            path = resolve_model(self.draft_ref, self.paths)
            draft = DraftModel(path, self.backend, self.n_ctx, self.n_threads, self.config.flash_attn)
        except DraftVocabError:
            self.backend.close()
            raise
        except EdgechatError as exc:
            warning = f"draft model not used: {exc}"
            log.warning("%s", warning)
            return None, warning
        return draft, None

    def _load_embedder(self) -> Embedder:
        """Embeddings from the model itself, or from --embedding-model (a context made on the
        first request, so a chat-only user never pays for it). A model that cannot embed is an
        error: it was asked for by name."""
        if self.config.embedding_model is None:
            return Embedder(self.backend, self.n_ctx, self.n_threads)
        try:
            path = resolve_model(self.config.embedding_model, self.paths)
            # LlamaBackend loads a model with a context: this one's is the smallest, never decoded
            backend = LlamaBackend(path, n_ctx_total=256, n_seq_max=1, n_threads=self.n_threads, n_batch=1, n_ubatch=1)
            try:
                return Embedder(backend, min(read_model_info(path).context_length, self.n_ctx), self.n_threads)
            except EdgechatError:
                backend.close()
                raise
        except EdgechatError:
            if self.draft is not None:
                self.draft.close()
            self.backend.close()
            raise

    def _check_draft(self, mode: SpeculativeMode | None) -> None:
        if mode is SpeculativeMode.DRAFT and self.draft_ref is None and not self.config.deterministic:
            raise UsageError("speculative decoding 'draft' needs a draft model (--draft-model)")

    def _speculative(self, req: ChatRequest) -> SpeculativeMode:
        if req.speculative is None or self.config.deterministic:
            return self.speculative_default
        return SpeculativeMode(req.speculative)

    def _restored_state(self, session: str, state: dict) -> None:
        self.states.update(session, **state)

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
        sched, embedder = self.scheduler, self.embedder
        stalled = False  # the last step ran nothing: its requests wait for images' encodes
        try:
            while True:
                block = not sched.active and not sched.waiting and not (embedder is not None and embedder.pending)
                keep_in = self._keep_idle_prompts()
                try:
                    if block or stalled:
                        # an encode's end puts a wake-up in the inbox (Scheduler's `wake`)
                        wait = IDLE_SNAPSHOT_S if block else ENCODE_POLL_S
                        item = self._inbox.get(timeout=wait if keep_in is None else min(wait, keep_in))
                    else:
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
                stalled = False
                try:
                    if isinstance(item, Running):
                        sched.waiting.append(item)
                        if block and sched.n_parallel > 1:
                            time.sleep(BATCH_WINDOW_S)
                    elif isinstance(item, EmbeddingJob):
                        assert embedder is not None  # embed() refuses work without one
                        embedder.add(item)
                    elif isinstance(item, _Command):
                        if self._command(item):
                            return
                    elif block and keep_in is None:  # idle for a while: put the conversations that changed on disk
                        for slot in self.slots:
                            self.kv.save_snapshot(slot)
                    else:
                        sched.admit()
                        if sched.active:
                            stalled = not sched.step() and sched.encoding
                        # one embedding chunk per chat step: a long batch holds the streams up
                        # for a chunk's decode at a time, never for the whole batch
                        if embedder is not None and embedder.pending:
                            embedder.step()
                except Exception as exc:  # a bug or a llama.cpp failure: fail the running requests, keep serving
                    log.exception("engine step failed")
                    sched.fail_running(exc)
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.exception("the engine thread died")
            raise
        finally:
            self._shut_down(reason)

    def _shut_down(self, reason: str) -> None:
        """The thread is ending: whatever was asked of it gets an answer, and nothing more comes in."""
        with self._lock:
            self._stopped = reason
        unqueued = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Running):
                unqueued.append(item)
            elif isinstance(item, EmbeddingJob) and self.embedder is not None:
                self.embedder.end(item, EngineStoppedError(f"the engine stopped ({reason}); restart edgechat"))
            else:
                item.error = EngineStoppedError(f"the engine stopped ({reason}); restart edgechat")
                item.done.set()
        self.scheduler.end_all(unqueued, None if reason == "closed" else f"the engine stopped ({reason})")
        if self.embedder is not None:
            self.embedder.fail_all(EngineStoppedError(f"the engine stopped ({reason}); restart edgechat"))

    def _command(self, cmd: _Command) -> bool:
        """Run one command; True when the engine is to stop. Its caller always gets an answer."""
        try:
            if cmd.name == "close":
                for slot in self.slots:
                    self.kv.save_snapshot(slot)
                self._keep_idle_prompts(at_close=True)
                self.prompt_cache.close()
                return True
            found = self.kv.slot_of(cmd.arg) if isinstance(cmd.arg, str) else None
            if cmd.name == "positions":
                cmd.result = self.kv.positions(found) if found is not None else None
            elif cmd.name == "check":
                cmd.result = self.kv.check() + (self.draft.problems() if self.draft is not None else []) + (self.embedder.problems() if self.embedder is not None else [])
            elif cmd.name == "continue":
                cmd.result = self.scheduler.continuation(*cmd.arg)
            elif cmd.name == "top_logits":
                cmd.result = self.scheduler.top_logits(*cmd.arg)
            elif cmd.name == "shed_cache":
                cmd.result = self.prompt_cache.shed()
            elif cmd.name == "release":
                if found is not None and not found.busy:
                    self.kv.save_snapshot(found)
            elif cmd.name == "forget":
                if found is not None and not found.busy:
                    self.kv.forget(found)
                self._snapshot_store().delete(cmd.arg)
                self.states.forget(cmd.arg)
            else:
                raise ValueError(f"unknown engine command {cmd.name!r}")
        except Exception as exc:
            log.exception("engine command %s failed", cmd.name)
            cmd.error = exc
        finally:
            cmd.done.set()
        return False

    # ------------------------------------------------------------------ snapshots
    def _keep_idle_prompts(self, at_close: bool = False) -> float | None:
        """With the prompt cache on disk: each idle sequence's state joins the prompt cache (which
        writes it) once the sequence has idled PROMPT_IDLE_S, or at close, so a hot prefix a slot
        holds outlives the process too. Returns the seconds until the next is due (None: none)."""
        if not self.prompt_cache.enabled or self.config.prompt_cache_disk <= 0:
            return None
        now, due = time.monotonic(), None
        for slot in self.slots:
            if slot.busy or slot.session is not None or not slot.tokens or self._kept_idle.get(slot.seq) == slot.last_used:
                continue
            wait = slot.last_used + PROMPT_IDLE_S - now
            if wait <= 0 or at_close:
                self.kv.stash(slot)
                self._kept_idle[slot.seq] = slot.last_used
            else:
                due = wait if due is None else min(due, wait)
        return due

    def _prompt_store(self) -> PromptStore:
        store = self._snapshot_store()
        return PromptStore(self.paths.snapshots / "prompts", store.tags, self.config.prompt_cache_disk)

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
                # the small sliding-window cache holds only the window's cells: its states and
                # the full cache's do not fit each other
                "swa_full": self.plan.swa_full,
                "state_version": state_version(),
            }
            self._snapshots = SnapshotStore(self.paths.snapshots, tags, self.config.snapshot_budget)
        return self._snapshots
