"""The llama.cpp model runner: one model and its context, the only code that runs llama.cpp's
model (llama_decode on a native llama_batch, logits, native samplers) and its KV memory.

Built on the low-level API (llama_decode, llama_batch, native sampler chains) rather than the
high-level Llama class, whose per-token Python sampling and logits copies cost 15-30% of decode speed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

import llama_cpp as L
import numpy as np

from edgechat.engine.runners.llamacpp import DecodeError, clear_log, ensure_backend, last_log_line, load_failure_reason
from edgechat.engine.runners.runner import TokenBatch
from edgechat.engine.runners.vocab import Vocabulary
from edgechat.errors import ModelFormatError
from quantize.llm import use_extra_buffers

log = logging.getLogger(__name__)

KV_TYPES = {"f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0, "q4_0": L.GGML_TYPE_Q4_0}
FLASH_ATTN = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def _progress_callback(report: Callable[[float], None]):
    """A llama_progress_callback that passes the loaded fraction (0..1) on and never aborts:
    an exception escaping into ctypes would return false, which cancels the load."""

    @L.llama_progress_callback
    def callback(fraction: float, user_data) -> bool:
        try:
            report(fraction)
        except Exception:
            log.exception("load progress callback failed")
        return True

    return callback


def state_version() -> int:
    """The version of llama.cpp's sequence state format (snapshots are tagged with it)."""
    return L.LLAMA_STATE_SEQ_VERSION


class Batch:
    """A reusable llama_batch; writes go straight into its C arrays."""

    def __init__(self, capacity: int, n_seq_max: int):
        self.capacity = capacity
        self._batch = L.llama_batch_init(capacity, 0, n_seq_max)
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq_id: int, want_logits: bool) -> int:
        b, i = self._batch, self.n
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = want_logits
        self.n = i + 1
        return i

    @property
    def free(self) -> int:
        return self.capacity - self.n

    def native(self):
        self._batch.n_tokens = self.n
        return self._batch

    def close(self) -> None:
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None


class LlamaBackend(Vocabulary):
    """One model and one context with n_seq_max sequences sharing a unified KV cache: the
    llama.cpp `ModelRunner` (engine/runners/runner.py), its text through the model's own
    `Vocabulary`."""

    #: seq_cp on a unified cache shares cells, it does not copy them
    shares_cells = True

    def __init__(
        self,
        path: Path,
        n_ctx_total: int,
        n_seq_max: int,
        n_threads: int,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        kv_type: str = "f16",
        n_gpu_layers: int | None = None,
        flash_attn: str = "auto",
        on_progress: Callable[[float], None] | None = None,
        swa_full: bool = True,
    ):
        ensure_backend()
        mparams = L.llama_model_default_params()
        mparams.use_extra_bufts = use_extra_buffers()
        if n_gpu_layers is not None:
            mparams.n_gpu_layers = n_gpu_layers
        if on_progress is not None:
            # kept in a local for the whole load: llama.cpp calls it while reading the tensors
            progress = _progress_callback(on_progress)
            mparams.progress_callback = progress
        clear_log()
        model = L.llama_model_load_from_file(os.fsencode(path), mparams)
        if not model:
            raise ModelFormatError(f"cannot load {Path(path).name}: {load_failure_reason()}")
        super().__init__(path, model)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx_total
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_ubatch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.kv_unified = True
        # full-size sliding-window cache (llama.cpp's default): rewinding a sequence for prefix
        # reuse, shifting it and restoring snapshots need the tokens a pruned window drops. The
        # small one (planner: where the full one does not fit) keeps a window and cannot shift.
        cparams.swa_full = swa_full
        cparams.no_perf = True
        cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
        # llama.cpp needs flash attention for a quantized V cache
        cparams.flash_attn_type = FLASH_ATTN["on" if kv_type != "f16" else flash_attn]
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            reason = load_failure_reason()
            self.close()
            raise ModelFormatError(f"cannot create a context for {self.path.name}: {reason}")
        self.ctx = ctx
        self.mem = L.llama_get_memory(ctx)
        self.n_ctx_total = L.llama_n_ctx(ctx)
        self.n_batch = L.llama_n_batch(ctx)
        self.n_seq_max = n_seq_max
        self.can_shift = bool(L.llama_memory_can_shift(self.mem))
        #: positions in several sections (M-RoPE): each cell's state carries its 2-D extension
        #: (llama_kv_cache::has_cell_ext)
        self.cell_ext = L.llama_model_rope_type(model) in (L.LLAMA_ROPE_TYPE_MROPE, L.LLAMA_ROPE_TYPE_IMROPE)
        #: the sliding layers' window (0: no sliding layers). Their cells older than the window
        #: may be missing even from a full cache: llama.cpp's sequence states leave them out
        self.swa_window = max(L.llama_model_n_swa(model), 0)
        #: the window, where the cache itself keeps only the window's cells (0: a full cache)
        self.small_swa = 0 if swa_full else self.swa_window

    def pooled_width(self, rank: bool) -> int:
        """The width of one pooled output: a classifier head's scores for a reranker (`rank`),
        else the model's embedding."""
        return L.llama_model_n_cls_out(self.model) if rank else L.llama_model_n_embd_out(self.model)

    # --- compute --------------------------------------------------------------------------------
    def new_batch(self, capacity: int) -> TokenBatch:
        return Batch(capacity, self.n_seq_max)

    def decode(self, batch: TokenBatch) -> None:
        assert isinstance(batch, Batch), "a llama.cpp batch comes from new_batch"
        rc = L.llama_decode(self.ctx, batch.native())
        if rc != 0:
            raise DecodeError(f"llama_decode failed ({rc}): {last_log_line()}")

    def sample(self, sampler, index: int) -> int:
        """A token through a SamplerChain's native chain, which reads the logits in place."""
        return L.llama_sampler_sample(sampler.chain, self.ctx, index)

    def logits(self, index: int) -> np.ndarray:
        """The logits at a batch index, a view valid until the next decode."""
        return np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, index), (self.n_vocab,))

    def argmax(self, index: int) -> int:
        """Greedy choice straight from the logits: the native chain first copies every logit into
        a candidate array, which costs ~0.4 ms a token on a 262k vocabulary."""
        return int(self.logits(index).argmax())

    def top_logits(self, index: int, n: int) -> list[tuple[int, float]]:
        """The n highest logits at a batch index, highest first (for checking near-ties)."""
        logits = self.logits(index)
        best = np.argpartition(logits, -n)[-n:]
        return sorted(((int(t), float(logits[t])) for t in best), key=lambda x: -x[1])

    # --- KV memory ------------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        if self.swa_window and p0 > 0 and p1 < 0 and L.llama_memory_seq_pos_min(self.mem, seq) > max(0, p0 - self.swa_window):
            # the sliding layers lack cells the window of position p0 needs (a small SWA cache
            # overwrote them, or a restored state left them out): a rewind this deep is refused,
            # as memory that cannot drop part of a sequence does
            return False
        return bool(L.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        L.llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        return L.llama_memory_seq_pos_min(self.mem, seq), L.llama_memory_seq_pos_max(self.mem, seq)

    def state_seq_get(self, seq: int) -> bytearray:
        """The sequence's serialized state, written by llama.cpp straight into the returned
        buffer (every sequence waits meanwhile: a zeroed ctypes array then copied into bytes made
        a 10 MB state take 1.7-2.8 ms at median here, this 1.4)."""
        size = L.llama_state_seq_get_size(self.ctx, seq)
        data = bytearray(size)
        n = L.llama_state_seq_get_data(self.ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq)
        del data[n:]
        return data

    def seq_cell_positions(self, seq: int) -> list[int]:
        """The positions of every cell the sequence holds, sorted, read from its serialized state
        (llama.cpp has no other way to list them). Layout: a u32 magic and the i32 sequence id,
        then llama_kv_cache::state_write's u32 stream count, per stream a u32 cell count and per
        cell an i32 position, a u32 count of sequence ids, (M-RoPE) the cell's extension x, y,
        token (3 x i32) and the ids; then the tensors, which are not read. With a
        sliding-window model the full-attention cache comes first, and it is the one read."""
        data = self.state_seq_get(seq)
        if len(data) < 16:
            return []
        _magic, seq_read, n_stream, n_cells = struct.unpack_from("<IiII", data, 0)
        if seq_read != seq or n_stream != 1:
            raise RuntimeError(f"unexpected state layout for sequence {seq} (seq {seq_read}, {n_stream} streams)")
        off, positions = 16, []
        ext = 12 if self.cell_ext else 0
        for _ in range(n_cells):
            pos, n_ids = struct.unpack_from("<iI", data, off)
            ids = struct.unpack_from(f"<{n_ids}i", data, off + 8 + ext)
            if ids != (seq,):
                raise RuntimeError(f"unexpected sequence ids {ids} in the state of sequence {seq}")
            positions.append(pos)
            off += 8 + ext + 4 * n_ids
        return sorted(positions)

    def state_seq_set(self, seq: int, data: bytes | bytearray) -> bool:
        # llama.cpp only reads the state: it gets the buffer itself, not a copy
        buf: ctypes.Array | ctypes._Pointer
        if isinstance(data, bytearray):
            buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        else:
            buf = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
        return L.llama_state_seq_set_data(self.ctx, buf, len(data), seq) == len(data)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        super().close()
