"""The engine: one thread owns the llama.cpp context and runs the scheduling loop.

Requests are prepared on the caller's thread (engine/prompt/prompt.py) and come in through a queue; the
thread runs the scheduler (engine/schedule/scheduler.py: admission, one llama_decode per step for every
running sequence), and every KV cache operation goes through the KV manager (engine/kv/kvcache.py).

Nothing a request, a callback or the disk does may leave a client waiting: every request gets a
Finished event, every command an answer within a bound, and a dead thread refuses new work.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from edgechat.config import Paths, get_paths, make_data_dir
from edgechat.engine.commands import Check, Command, Continue, Forget, Parts, Positions, Release, ShedCache, TopLogits
from edgechat.engine.embeddings import Embedder, EmbeddingJob
from edgechat.engine.kv.kvcache import KVManager, Slot
from edgechat.engine.kv.promptcache import PromptCache
from edgechat.engine.kv.sessions import Conversations, ConversationStates
from edgechat.engine.kv.snapshots import PromptStore, SnapshotStore, model_fingerprint
from edgechat.engine.loop import COMMAND_TIMEOUT_S, EngineLoop
from edgechat.engine.prompt.fim import InfillBuilder
from edgechat.engine.prompt.prompt import Prepared, PromptBuilder, SummaryNeeded
from edgechat.engine.prompt.templates import choose_format
from edgechat.engine.runners import devices
from edgechat.engine.runners.llama import LlamaBackend, state_version
from edgechat.engine.runners.media import Projector
from edgechat.engine.runners.runner import ModelRunner
from edgechat.engine.runners.sampling import grammar_parses
from edgechat.engine.schedule.draft import DraftModel, DraftVocabError
from edgechat.engine.schedule.running import Running
from edgechat.engine.schedule.scheduler import PREFILL_CHUNK_BUSY, Scheduler
from edgechat.engine.types.metrics import RequestClock
from edgechat.engine.types.request import ChatRequest, ContextPolicy, RequestHandle
from edgechat.errors import EdgechatError, EngineStoppedError, UsageError
from edgechat.models import catalog_draft, display_name, find_projector, planner, read_model_info, resolve_model
from edgechat.params import CHOICES, FlashAttn, Grammar, KVType, SamplingParams, SpeculativeMode, SwaCache, choice

if TYPE_CHECKING:
    from edgechat.engine.runners.onnxrt import OnnxPlacement

log = logging.getLogger("edgechat.engine")


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
    #: prompt tokens a step prefills while other sequences decode (chunked prefill): smaller keeps
    #: the streams' token times steadier while a long prompt arrives, larger reads it sooner
    prefill_chunk: int = PREFILL_CHUNK_BUSY
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


class RequestRules:
    """What this engine makes of a request's own settings: its context policy where the cache
    cannot shift, its speculative mode where the engine is deterministic."""

    def __init__(self, runner: ModelRunner, speculative_default: SpeculativeMode, deterministic: bool):
        self.runner = runner
        self.speculative_default = speculative_default
        self.deterministic = deterministic
        self._shift_warned = False

    def policy(self, req: ChatRequest) -> ContextPolicy:
        policy = ContextPolicy(req.context_policy)
        if policy is ContextPolicy.SHIFT and not self.runner.can_shift:
            if not self._shift_warned:
                log.warning("this model's KV cache cannot shift positions; falling back to 'truncate'")
                self._shift_warned = True
            return ContextPolicy.TRUNCATE
        return policy

    def speculative(self, req: ChatRequest) -> SpeculativeMode:
        if req.speculative is None or self.deterministic:
            return self.speculative_default
        return SpeculativeMode(req.speculative)


class Engine:
    """See edgechat/engine/__init__.py for the public contract.

    Built from parts, each handed what it needs by name: the model's runner; the conversations
    (their states and snapshots); the prompt cache; the KV manager over the runner, the prompt
    cache and the conversations; the prompt builder over the chat format, the tokenizer and the
    conversations; the scheduler over the runner, the KV manager and the request rules; the
    engine thread (engine/loop.py) over all of them."""

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
            functools.partial(_is_special_token, be),
        )
        self.template_mode = self.format.mode
        self.template_warning = self.format.warning
        self.rules = RequestRules(be, self.speculative_default, cfg.deterministic)
        self._cache_parts()
        if self.onnx:
            self.draft, self.draft_warning, self.embedder = None, None, None
        else:
            self.draft, self.draft_warning = self._load_draft()
            self.embedder = self._load_embedder()
        self.prompts = self._prompt_builder()
        inbox: queue.Queue = queue.Queue()
        self.scheduler = Scheduler(
            runner=be, kv=self.kv, states=self.conversations.states, n_ctx=self.n_ctx,
            n_parallel=1 if cfg.deterministic else cfg.n_parallel, policy=self.rules.policy,
            speculative=self.rules.speculative, draft=self.draft, deterministic=cfg.deterministic,
            reasoning=self.format.reasoning, projector=self.projector, wake=lambda: inbox.put(None),
            tool_family=self.format.tool_family, prefill_chunk=cfg.prefill_chunk,
        )
        self._closed = False
        self.loop = EngineLoop(Parts(kv=self.kv, conversations=self.conversations, prompt_cache=self.prompt_cache,
                                     scheduler=self.scheduler, draft=self.draft, embedder=self.embedder,
                                     prompt_disk=cfg.prompt_cache_disk > 0), inbox)

    def _prompt_builder(self) -> PromptBuilder:
        be = self.backend
        bos = be.bos if be.add_bos else None

        def special(text: str) -> list[int]:
            return be.tokenize(text, add_bos=False, special=True)

        def plain(text: str) -> list[int]:
            return be.tokenize(text, add_bos=False, special=False)

        infill = InfillBuilder(be.fim_tokens(), tokenize=plain, tokenize_special=special, bos=bos, n_batch=be.n_batch,
                               model_name=self.model_name)
        return PromptBuilder(self.format, special, bos=bos, n_ctx=self.n_ctx, conversations=self.conversations,
                             projector=self.projector, model_name=self.model_name, infill=infill, n_vocab=be.n_vocab)

    def _cache_parts(self) -> None:
        """The conversations (their states and snapshots), the prompt cache, and the KV manager
        over both."""
        cfg = self.config
        tags = functools.partial(_snapshot_tags, self.paths, self.model_path, self.n_ctx, cfg.kv_type, self.plan.swa_full)
        self.conversations = Conversations(ConversationStates(), SnapshotStore(self.paths.snapshots, tags, cfg.snapshot_budget))
        snapshots = self.conversations.snapshots
        # a restored state's cells were computed in other batches than a fresh prefill's
        self.prompt_cache = PromptCache(0 if cfg.deterministic else cfg.prompt_cache_budget, lambda: snapshots.tags)
        self.kv = KVManager(self.backend, self.n_slots, prompt_cache=self.prompt_cache, conversations=self.conversations,
                            mrope=self.projector is not None and self.projector.mrope)
        if self.prompt_cache.enabled and cfg.prompt_cache_disk > 0:
            self._attach_prompt_store()

    def _attach_prompt_store(self) -> None:
        folder = self.paths.snapshots / "prompts"
        try:
            self.prompt_cache.attach(PromptStore(folder, self.conversations.snapshots.tags, self.config.prompt_cache_disk))
        except OSError as exc:  # a read-only or full disk: the cache serves from RAM alone
            log.warning("the prompt cache stays in RAM: cannot use %s (%s)", folder, exc)

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
            prep = self._build(request)
        else:
            prep = prepared
            self.prompts.check(request, prep)
        clock.tokenize = time.perf_counter() - clock.submitted
        handle = RequestHandle(request, on_event)
        with self.loop.accepting() as inbox:
            self.scheduler.reserve(self.config.max_queue)
            inbox.put(Running(handle, request, prep, clock))
        return handle

    def prepare(self, request: ChatRequest) -> Prepared:
        """The prompt submit() would build for this request (template, tokens, eviction), without
        the limit check; front ends that look at it first hand it to submit()."""
        return self._build(request, check_limit=False)

    def prompt_tokens(self, request: ChatRequest) -> list[int]:
        """The exact tokens the model would be given for this request (template applied)."""
        return list(self.prepare(request).tokens)

    def count_tokens(self, request: ChatRequest) -> int:
        return len(self.prompt_tokens(request))

    def prompt_text_tokens(self, text: str, add_bos: bool = True) -> list[int]:
        """`text`'s tokens as a raw prompt's (special tokens parsed) and, with `add_bos`, the BOS
        the model wants first: what llama-server's /tokenize gives by default."""
        if add_bos:
            return list(self.prompts.tokens_for([text])[0])
        return self.backend.tokenize(text, add_bos=False, special=True)

    def embed(self, inputs: list[str | list[int]], truncate: bool = False, on_done=None) -> EmbeddingJob:
        """Queue texts or token arrays for embedding (engine/embeddings.py); bad inputs raise
        EmbeddingInputError here. `on_done(job)` is called on the engine thread at its end."""
        self._check_running()
        if self.embedder is None:
            raise UsageError("embeddings need a GGUF model; ONNX folders do not compute them")
        job = EmbeddingJob(self.embedder.prepare(inputs, truncate), on_done)
        with self.loop.accepting() as inbox:
            inbox.put(job)
        return job

    def rerank(self, query: str, documents: list[str], truncate: bool = False, on_done=None) -> EmbeddingJob:
        """Queue a reranker's scores of each document for `query` (its vectors: one score per
        label), as `embed` queues vectors; a model that is not a reranker raises UsageError."""
        self._check_running()
        if self.embedder is None:
            raise UsageError("reranking needs a GGUF model; ONNX folders do not compute it")
        job = EmbeddingJob(self.embedder.prepare_rerank(query, documents, truncate), on_done)
        with self.loop.accepting() as inbox:
            inbox.put(job)
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
        self._command(Release(session), wait)

    def forget_session(self, session: str) -> None:
        """The conversation was deleted: drop its sequence and snapshot."""
        self._command(Forget(session))

    def seq_positions(self, session: str) -> tuple[int, int, int] | None:
        """(pos_min, pos_max, mirrored length) of a session's sequence, for consistency checks."""
        return self._command(Positions(session))

    def shed_prompt_cache(self) -> int:
        """Memory is short: the prompt cache lets go of its states in RAM (those on disk stay
        and are read back when asked). The bytes let go."""
        return self._command(ShedCache())

    def kv_problems(self) -> list[str]:
        """Every way the KV mirrors disagree with llama.cpp's cells (empty when consistent)."""
        return self._command(Check())

    def greedy_continuation(self, n: int, session: str | None = None, tokens: list[int] | None = None) -> list[int]:
        """For consistency checks: the n tokens greedy decoding appends to a session's cached
        sequence (which is left as it was), or to `tokens` prefilled cold in an idle slot."""
        return self._command(Continue(n, session, tokens))

    def top_logits(self, tokens: list[int], n: int = 2) -> list[tuple[int, float]]:
        """For checking near-ties: the n highest (token, logit) after `tokens`, prefilled cold."""
        return self._command(TopLogits(tokens, n))

    @property
    def stopped(self) -> str | None:
        """Why the engine thread ended without being closed (a bug, a llama.cpp failure); None
        while it runs."""
        if self._closed:
            return None
        return self.loop.stopped or (None if self.loop.alive else "its thread ended")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.loop.close():
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
        self.loop.check_running()

    def _command(self, command: Command, wait: bool = True):
        self._check_running()
        return self.loop.call(command, wait)

    # ---------------------------------------------------------------- prompts
    def _build(self, request: ChatRequest, check_limit: bool = True) -> Prepared:
        """The request's prompt. Where the summarize policy needs the model first, the summary is
        a request of its own through the engine's loop, and the builder goes on with its text."""
        built = self.prompts.prepare(request, self.rules.policy(request), check_limit)
        if isinstance(built, SummaryNeeded):
            built = self.prompts.summarized(built, self._summary(built))
        return built

    def _summary(self, need: SummaryNeeded) -> str | None:
        try:
            done = self.submit(need.request(self.n_ctx)).result(timeout=COMMAND_TIMEOUT_S)
        except (EdgechatError, TimeoutError) as exc:
            log.warning("could not summarize evicted messages (%s); they are dropped instead", exc)
            return need.previous
        return done.text.strip() or need.previous

    # ---------------------------------------------------------------- the parts that load
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


def _is_special_token(runner: ModelRunner, text: str) -> bool:
    """The text is one control token of the model's (a template's own markers)."""
    toks = runner.tokenize(text, add_bos=False, special=True)
    return len(toks) == 1 and runner.is_control(toks[0])


def _snapshot_tags(paths: Paths, model_path: Path, n_ctx: int, kv_type: KVType, swa_full: bool) -> dict:
    """What a snapshot's cells depend on; computed when the first snapshot is read or written
    (it hashes the model), after the data folder is made private."""
    try:
        make_data_dir(paths)  # private (0700) before the first snapshot lands there
    except OSError as exc:
        log.warning("cannot create %s (%s); conversations will not be snapshotted", paths.snapshots, exc)
    return {
        "model_sha256": model_fingerprint(model_path, paths.cache),
        "n_ctx": n_ctx,
        "kv_type": kv_type,
        # the small sliding-window cache holds only the window's cells: its states and the full
        # cache's do not fit each other
        "swa_full": swa_full,
        "state_version": state_version(),
    }
