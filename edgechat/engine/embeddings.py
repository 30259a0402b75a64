"""Embeddings: one unit-length vector per input, from a second llama.cpp context on a loaded model.

The context (llama.cpp's `embeddings` mode) pools with the type the GGUF names (mean, cls or
last); a model that names none (decoder chat models such as SmolLM2) is pooled by the mean of
its tokens' hidden states. Many inputs go through one decode, one sequence id each, packed up to
the context's batch; an input longer than the room left is split, its later part decoded in the
next chunk on top of its cells, and its parts' vectors combined (a mean weighted by tokens; the
first part's for cls, the last part's for last), so every chunk is full whatever the lengths.
Encoder-only models (no cache) take each input whole.

The engine thread runs one chunk per turn of its loop, between two chat steps (core.py), so a long
batch holds the chat streams up no longer than one prompt chunk of another request does.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgechat.engine.runners.llama import Batch, LlamaBackend
from edgechat.engine.runners.pooling import EmbeddingContext, Pooling
from edgechat.engine.schedule.scheduler import PREFILL_CHUNK_BUSY
from edgechat.errors import UsageError

log = logging.getLogger("edgechat.engine")

#: tokens per decode: the scheduler's prompt chunk while streams run (a chunk stalls them no
#: longer than a prefill does), less where the vocabulary is large: llama.cpp computes and copies
#: logits for every token of an embedding batch, LOGITS_BUDGET bytes at most
MAX_BATCH = PREFILL_CHUNK_BUSY
LOGITS_BUDGET = 128 << 20
#: sequences per decode (llama.cpp's unified cache allows 256)
MAX_SEQS = 64
#: the most inputs one request may send (OpenAI's limit)
MAX_INPUTS = 2048

POOLED = (Pooling.MEAN, Pooling.CLS, Pooling.LAST)


class EmbeddingInputError(UsageError):
    """An input the model cannot embed; `index` is its place in the request."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


@dataclass(eq=False)  # compared and hashed by identity: it is a piece of work, not a value
class EmbeddingJob:
    """One request's inputs, as token ids; `vectors` fill in as the engine thread gets to them."""

    inputs: list[list[int]]
    on_done: Callable[[EmbeddingJob], None] | None = None
    vectors: list[np.ndarray | None] = field(default_factory=list)
    #: why it has no vectors (None: it has them, or it was cancelled)
    error: BaseException | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    #: the input being fed and how many of its tokens are decoded
    next: int = 0
    offset: int = 0

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.inputs)

    def cancel(self) -> None:
        self.cancelled = True

    def result(self, timeout: float | None = None) -> list[np.ndarray]:
        if not self.done.wait(timeout):
            raise TimeoutError("the embeddings were not computed in time")
        if self.error is not None:
            raise self.error
        return self.vectors  # type: ignore[return-value]


def pooling_of(backend: LlamaBackend) -> int:
    """The pooling the GGUF names (rank: a reranker); mean where it names none (a decoder chat model)."""
    value = backend.meta(f"{backend.meta('general.architecture')}.pooling_type")
    pooling = int(value) if value and value.lstrip("-").isdigit() else Pooling.NONE
    return pooling if pooling in (*POOLED, Pooling.RANK) else Pooling.MEAN


class Embedder:
    """The embedding context of one model and the jobs waiting for it (engine thread only, but
    `prepare`, which any thread may call)."""

    def __init__(self, backend: LlamaBackend, max_tokens: int, n_threads: int):
        self.backend = backend
        self.pooling = pooling_of(backend)
        #: a reranker: each input is a query and a document, its vector their scores (not normalized)
        self.rank = self.pooling == Pooling.RANK
        logits_cap = LOGITS_BUDGET // (4 * backend.n_vocab)
        n_batch = max(32, min(MAX_BATCH, 1 << max(logits_cap.bit_length() - 1, 0)))
        self.n_batch = n_batch
        # llama.cpp sizes its outputs for at least one per sequence, within a batch's outputs
        self.n_seqs = min(MAX_SEQS, n_batch)
        self.n_embd = backend.pooled_width(self.rank)
        #: whether an input may span decodes: not for a bidirectional encoder (BERT), which
        #: has no cache and sees all its tokens at once (checked again on the context itself)
        self.splittable = backend.meta(f"{backend.meta('general.architecture')}.attention.causal") != "false"
        #: the longest input: the chat context's length, or one batch for an encoder
        self.max_tokens = max_tokens
        self._n_threads = n_threads
        self._ctx: EmbeddingContext | None = None
        self._batch: Batch | None = None
        self.queue: deque[EmbeddingJob] = deque()
        #: per (job, input) being split across chunks: its parts' pooled sum so far
        self._sums: dict[tuple[int, int], np.ndarray] = {}

    # ---------------------------------------------------------------- any thread
    def prepare(self, inputs: list[str | list[int]], truncate: bool = False) -> list[list[int]]:
        """Token ids for each input (text tokenized as llama-server does: BOS/EOS per the
        vocabulary), checked: not empty, every id in the vocabulary, no longer than max_tokens
        (cut to it with `truncate`)."""
        if self.rank:
            raise UsageError(f"{self.backend.path.name} is a reranker (rank pooling), not an embedding model; send it queries and documents (/v1/rerank)")
        return self._checked(inputs, truncate, lambda item: self.backend.tokenize(item, add_bos=True, special=False))

    def prepare_rerank(self, query: str, documents: list[str], truncate: bool = False) -> list[list[int]]:
        """Each document's input with the query (engine/runners/vocab.py's `rerank_pair`), checked as
        `prepare` checks inputs; a model that is not a reranker is refused in one line."""
        if not self.rank:
            raise UsageError(f"{self.backend.path.name} is not a reranker (its GGUF's pooling is not rank); "
                             "serve a reranker GGUF with --embedding-model")
        return self._checked(documents, truncate, lambda doc: self.backend.rerank_pair(query, doc))

    def _checked(self, inputs: list, truncate: bool, tokenize: Callable[[str], list[int]]) -> list[list[int]]:
        if not inputs:
            raise EmbeddingInputError("there is nothing to embed", 0)
        if len(inputs) > MAX_INPUTS:
            raise EmbeddingInputError(f"{len(inputs)} inputs, more than the {MAX_INPUTS} one request may send", 0)
        be, out = self.backend, []
        for i, item in enumerate(inputs):
            tokens = tokenize(item) if isinstance(item, str) else list(item)
            if not tokens:
                raise EmbeddingInputError(f"input {i} is empty", i)
            bad = next((t for t in tokens if not 0 <= t < be.n_vocab), None)
            if bad is not None:
                raise EmbeddingInputError(f"input {i}: token id {bad} is not in the vocabulary (0..{be.n_vocab - 1})", i)
            if len(tokens) > self.limit:
                if not truncate:
                    raise EmbeddingInputError(f"input {i} has {len(tokens)} tokens, more than the {self.limit} the embedding context holds", i)
                tokens = tokens[: self.limit]
            out.append(tokens)
        return out

    @property
    def limit(self) -> int:
        return self.max_tokens if self.splittable else min(self.max_tokens, self.n_batch)

    # ---------------------------------------------------------------- engine thread
    def add(self, job: EmbeddingJob) -> None:
        try:
            self._open()
        except Exception as exc:  # no context for it (memory, a model llama.cpp cannot embed with)
            log.exception("cannot create the embedding context")
            self.end(job, exc)
            return
        too_long = next((i for i, t in enumerate(job.inputs) if len(t) > self.limit), None)
        if too_long is not None:  # the context has no cache after all: inputs go in whole
            n = len(job.inputs[too_long])
            self.end(job, EmbeddingInputError(f"input {too_long} has {n} tokens, more than the {self.limit} this model takes at once", too_long))
            return
        job.vectors = [None] * len(job.inputs)
        self.queue.append(job)

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def step(self) -> None:
        """Decode one chunk of the waiting inputs and collect the vectors it completes."""
        ctx, batch = self._ctx, self._batch
        assert ctx is not None and batch is not None, "a job is queued only after _open"
        batch.clear()
        parts: list[tuple[EmbeddingJob, int, int, int]] = []  # job, input, sequence, its tokens here
        for job in list(self.queue):
            if job.cancelled:
                self._drop(job, None)
                continue
            # only the first job can be part-way through an input: it gets sequence 0 again
            while job.next < len(job.inputs) and batch.free and len(parts) < self.n_seqs:
                tokens = job.inputs[job.next]
                take = min(len(tokens) - job.offset, batch.free)
                if take < len(tokens) - job.offset and not self.splittable:
                    break
                for pos in range(job.offset, job.offset + take):
                    batch.add(tokens[pos], pos, len(parts), True)
                parts.append((job, job.next, len(parts), take))
                job.offset += take
                if job.offset < len(tokens):
                    break  # the chunk is full: the rest goes in the next one, on these cells
                job.next, job.offset = job.next + 1, 0
            if job.next < len(job.inputs):
                break
        if not parts:
            return
        try:
            ctx.decode(batch)
            for job, index, seq, take in parts:
                self._collect(ctx, job, index, seq, take)
        except Exception as exc:  # this batch's jobs fail; the chat requests go on
            log.exception("embedding decode failed")
            ctx.clear()
            for job in {p[0]: None for p in parts}:
                self._drop(job, RuntimeError(f"embedding failed: {exc}"))
            return
        last_job, last_index, last_seq, _ = parts[-1]
        carried = last_seq if last_job.offset and last_job.next == last_index else None
        if carried is None:
            ctx.clear()
        else:  # the input that goes on keeps its cells, as sequence 0
            for _job, _index, seq, _take in parts[:-1]:
                ctx.seq_rm(seq)
            if carried != 0:
                ctx.seq_move(carried, 0)
        for job in list(self.queue):
            if job.next == len(job.inputs):
                self.queue.remove(job)
                self.end(job, None)

    def _collect(self, ctx: EmbeddingContext, job: EmbeddingJob, index: int, seq: int, take: int) -> None:
        vec = ctx.vector(seq)
        key = (id(job), index)
        finished = job.next > index
        first = key not in self._sums
        if self.pooling == Pooling.MEAN:  # a sum of the parts: its direction is the mean's
            total = vec.astype(np.float64) * take + (self._sums.pop(key) if not first else 0)
        elif self.pooling == Pooling.CLS:
            total = vec.astype(np.float64) if first else self._sums.pop(key)
        else:  # last: the last part's vector
            self._sums.pop(key, None)
            total = vec.astype(np.float64)
        if not finished:
            self._sums[key] = total
            return
        norm = 0 if self.rank else np.linalg.norm(total)
        job.vectors[index] = (total / norm if norm > 0 else total).astype(np.float32)

    def _drop(self, job: EmbeddingJob, error: BaseException | None) -> None:
        """Take a job out before its end (cancelled, failed): its part-sums and cells go too."""
        if job in self.queue:
            if job is self.queue[0] and job.offset and self._ctx is not None:
                self._ctx.clear()  # its unfinished input held sequence 0, and nothing else is held
            self.queue.remove(job)
        for key in [k for k in self._sums if k[0] == id(job)]:
            del self._sums[key]
        self.end(job, error)

    def end(self, job: EmbeddingJob, error: BaseException | None) -> None:
        job.error = error
        job.done.set()
        if job.on_done is not None:
            job.on_done(job)

    def fail_all(self, error: BaseException) -> None:
        for job in list(self.queue):
            self._drop(job, error)

    def problems(self) -> list[str]:
        """Cells left behind in the embedding context while no job runs (empty when none)."""
        if self._ctx is None or self.queue:
            return []
        held = [s for s in range(self.n_seqs) if self._ctx.seq_pos_range(s) != (-1, -1)]
        return [f"embedding context: sequence {s} holds cells {self._ctx.seq_pos_range(s)} while idle" for s in held]

    def _open(self) -> None:
        """The context, made on first use: a chat-only user never pays for its cache."""
        if self._ctx is not None:
            return
        # cells for one chunk and the earlier parts of an input that goes on past it
        ctx = EmbeddingContext(self.backend.model, self.max_tokens + self.n_batch, self.n_batch, self.n_seqs, self._n_threads, self.pooling)
        self.splittable = ctx.mem is not None and ctx.causal
        self._ctx, self._batch = ctx, Batch(self.n_batch, 1)

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
        if self._ctx is not None:
            self._ctx.close()
