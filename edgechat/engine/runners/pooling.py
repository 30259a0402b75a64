"""llama.cpp's embeddings mode: a context on a loaded model that pools each sequence into one
vector (what engine/embeddings.py's `Embedder` runs for /v1/embeddings and /v1/rerank)."""

from __future__ import annotations

import enum

import llama_cpp as L
import numpy as np

from edgechat.engine.runners.llama import Batch
from edgechat.engine.runners.llamacpp import DecodeError, last_log_line, load_failure_reason
from edgechat.errors import ModelFormatError


class Pooling(enum.IntEnum):
    """How llama.cpp pools a sequence's embeddings (a GGUF's pooling_type)."""

    NONE = L.LLAMA_POOLING_TYPE_NONE
    MEAN = L.LLAMA_POOLING_TYPE_MEAN
    CLS = L.LLAMA_POOLING_TYPE_CLS
    LAST = L.LLAMA_POOLING_TYPE_LAST
    RANK = L.LLAMA_POOLING_TYPE_RANK


class EmbeddingContext:
    """A second llama.cpp context on a loaded model that pools each sequence's hidden states into
    one vector (llama.cpp's `embeddings` mode): every token is an output, nothing is sampled."""

    def __init__(self, model, n_ctx: int, n_batch: int, n_seq_max: int, n_threads: int, pooling: int):
        cparams = L.llama_context_default_params()
        cparams.embeddings = True
        cparams.pooling_type = pooling
        cparams.n_ctx = n_ctx
        # one ubatch per decode: llama.cpp pools per ubatch, so a sequence split across two
        # would get the second part's vector only
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.kv_unified = True
        cparams.no_perf = True
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelFormatError(f"cannot create an embedding context: {load_failure_reason()}")
        self.ctx = ctx
        #: None for encoder-only models (BERT): no cache, so an input cannot span two decodes
        self.mem = L.llama_get_memory(ctx) or None
        self.causal = bool(L.llama_get_causal_attn(ctx))
        # a reranker's (rank pooling) output is its classifier's scores, one per label
        self.n_embd = L.llama_model_n_cls_out(model) if pooling == L.LLAMA_POOLING_TYPE_RANK else L.llama_model_n_embd_out(model)
        self.n_batch = L.llama_n_batch(ctx)

    def decode(self, batch: Batch) -> None:
        rc = L.llama_decode(self.ctx, batch.native())
        if rc != 0:
            raise DecodeError(f"llama_decode failed ({rc}): {last_log_line()}")

    def vector(self, seq: int) -> np.ndarray:
        """The pooled vector of a sequence in the last decode (a copy)."""
        ptr = L.llama_get_embeddings_seq(self.ctx, seq)
        if not ptr:
            raise DecodeError(f"llama.cpp returned no embedding for sequence {seq}")
        return np.ctypeslib.as_array(ptr, (self.n_embd,)).copy()

    def seq_rm(self, seq: int) -> None:
        if self.mem is not None:
            L.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def seq_move(self, src: int, dst: int) -> None:
        # a unified cache shares the cells: the copy costs nothing, the removal unlabels them
        L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        L.llama_memory_seq_rm(self.mem, src, -1, -1)

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        if self.mem is None:
            return -1, -1
        return L.llama_memory_seq_pos_min(self.mem, seq), L.llama_memory_seq_pos_max(self.mem, seq)

    def clear(self) -> None:
        if self.mem is not None:
            L.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
