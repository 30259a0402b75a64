"""The llama.cpp backend: the only module that calls llama.cpp's C API (through llama-cpp-python's ctypes).

Built on the low-level API (llama_decode, llama_batch, native sampler chains) rather than the
high-level Llama class, whose per-token Python sampling and logits copies cost 15-30% of decode speed.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import re
import struct
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L
import numpy as np

from edgechat.engine.runners.runner import TokenBatch
from edgechat.errors import ModelFormatError
from quantize.llm import use_extra_buffers

log = logging.getLogger(__name__)

KV_TYPES = {"f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0, "q4_0": L.GGML_TYPE_Q4_0}
FLASH_ATTN = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}

#: a model's image/audio/video placeholder tokens: GGUF marks them user-defined, not control, so
#: llama.cpp renders them as text, but they are never part of an answer (Gemma 3 270M base wrote
#: runs of `<start_of_image>`). Other user-defined tokens (`<think>`, `<tool_call>`) are text the
#: output processor and the tool parser read, so they stay.
_MEDIA_MARKER = re.compile(rb"<\|?[a-z_]*(?:image|img|vision|video|audio)[a-z0-9_]*\|?>", re.IGNORECASE)

_init_lock = threading.Lock()
_initialised = False
#: recent llama.cpp log lines, to explain a failed load in one line
_log_lines: deque[str] = deque(maxlen=64)


@L.llama_log_callback
def _log_callback(level: int, text: bytes, user_data) -> None:
    # llama.cpp logs a great deal to stderr by default; keep it for error messages instead.
    if text:
        _log_lines.append(text.decode("utf-8", errors="replace"))


def _ensure_backend() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            L.llama_log_set(_log_callback, ctypes.c_void_p(0))
            L.llama_backend_init()
            _initialised = True


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


def _load_failure_reason() -> str:
    text = "".join(_log_lines)
    for line in reversed(text.splitlines()):
        if "unknown model architecture" in line:
            arch = line.rsplit(":", 1)[-1].strip()
            return f"unknown model architecture {arch}; this llama.cpp build cannot run it, pick another model (edgechat models)"
    for line in reversed(text.splitlines()):
        if "error loading model:" in line:
            return line.split("error loading model:", 1)[1].strip()
    return "llama.cpp could not load it; the file may be damaged or of a newer format"


def llama_version() -> str:
    return L.__version__


def system_info() -> str:
    _ensure_backend()
    return L.llama_print_system_info().decode("utf-8", errors="replace")


def supports_gpu_offload() -> bool:
    _ensure_backend()
    return bool(L.llama_supports_gpu_offload())


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle token ids (-1: none), as llama.cpp reads them: the GGUF's
    tokenizer.ggml.fim_*_token_id keys, the older prefix/suffix/middle ones, else the tokens known
    by their text (<|fim_prefix|>, <PRE>, ...)."""

    pre: int = -1
    suf: int = -1
    mid: int = -1
    pad: int = -1
    #: repository-level context (Qwen2.5-Coder's <|repo_name|>, <|file_sep|>)
    rep: int = -1
    sep: int = -1

    def missing(self) -> list[str]:
        """The tokens a fill needs and the vocabulary lacks."""
        return [name for name, tok in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if tok < 0]


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


class Pooling(enum.IntEnum):
    """How llama.cpp pools a sequence's embeddings (a GGUF's pooling_type)."""

    NONE = L.LLAMA_POOLING_TYPE_NONE
    MEAN = L.LLAMA_POOLING_TYPE_MEAN
    CLS = L.LLAMA_POOLING_TYPE_CLS
    LAST = L.LLAMA_POOLING_TYPE_LAST
    RANK = L.LLAMA_POOLING_TYPE_RANK


def state_version() -> int:
    """The version of llama.cpp's sequence state format (snapshots are tagged with it)."""
    return L.LLAMA_STATE_SEQ_VERSION


class DecodeError(RuntimeError):
    pass


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
            raise ModelFormatError(f"cannot create an embedding context: {_load_failure_reason()}")
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
            raise DecodeError(f"llama_decode failed ({rc}): " + (_log_lines[-1].strip() if _log_lines else ""))

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


class LlamaBackend:
    """One model and one context with n_seq_max sequences sharing a unified KV cache: the
    llama.cpp `ModelRunner` (engine/runners/runner.py)."""

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
        _ensure_backend()
        self.path = Path(path)
        mparams = L.llama_model_default_params()
        mparams.use_extra_bufts = use_extra_buffers()
        if n_gpu_layers is not None:
            mparams.n_gpu_layers = n_gpu_layers
        if on_progress is not None:
            # kept in a local for the whole load: llama.cpp calls it while reading the tensors
            progress = _progress_callback(on_progress)
            mparams.progress_callback = progress
        _log_lines.clear()
        model = L.llama_model_load_from_file(os.fsencode(self.path), mparams)
        if not model:
            raise ModelFormatError(f"cannot load {self.path.name}: {_load_failure_reason()}")
        self.model = model
        self._read_vocab()
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
            L.llama_model_free(model)
            raise ModelFormatError(f"cannot create a context for {self.path.name}: {_load_failure_reason()}")
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

    def _read_vocab(self) -> None:
        """The loaded model's vocabulary and special tokens, and the piece cache."""
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos = L.llama_vocab_bos(self.vocab)
        self.eos = L.llama_vocab_eos(self.vocab)
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)

    # --- metadata -------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @property
    def n_cls_out(self) -> int:
        """A classifier head's outputs (a reranker's scores)."""
        return L.llama_model_n_cls_out(self.model)

    @property
    def n_embd_out(self) -> int:
        """The width of the model's embeddings."""
        return L.llama_model_n_embd_out(self.model)

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    @property
    def vocab_type(self) -> int:
        """llama.cpp's tokenizer type (SPM, BPE, WPM, ...)."""
        return L.llama_vocab_type(self.vocab)

    @property
    def eot(self) -> int:
        """The end-of-turn token (-1: none)."""
        return L.llama_vocab_eot(self.vocab)

    def rerank_pair(self, query: str, document: str) -> list[int]:
        """A reranker's input for one query and document, as llama-server builds it: the GGUF's
        `rerank` template with both filled in, else [BOS] query [EOS] [SEP] document [EOS], each
        marker where the vocabulary adds it (BERT: [CLS] query [SEP] document)."""
        template = L.llama_model_chat_template(self.model, b"rerank")
        if template:
            text = template.decode().replace("{query}", query).replace("{document}", document)
            return self.tokenize(text, add_bos=False, special=True)
        v = self.vocab
        eos = self.eos if self.eos >= 0 else L.llama_vocab_sep(v)
        add_eos = [eos] if L.llama_vocab_get_add_eos(v) else []
        tokens = [self.bos] if self.add_bos else []
        tokens += self.tokenize(query, special=False) + add_eos
        tokens += [L.llama_vocab_sep(v)] if L.llama_vocab_get_add_sep(v) else []
        return tokens + self.tokenize(document, special=False) + add_eos

    def fim_tokens(self) -> FimTokens:
        """The fill-in-the-middle tokens (engine/prompt/fim.py), as llama.cpp found them in the GGUF."""
        v = self.vocab
        return FimTokens(L.llama_vocab_fim_pre(v), L.llama_vocab_fim_suf(v), L.llama_vocab_fim_mid(v),
                         L.llama_vocab_fim_pad(v), L.llama_vocab_fim_rep(v), L.llama_vocab_fim_sep(v))

    def token_bytes(self, token: int) -> bytes:
        """A token's text in the vocabulary, as stored (no decoding: compared across vocabularies)."""
        return L.llama_vocab_get_text(self.vocab, token) or b""

    # --- text -----------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        return buf[:n]

    def piece(self, token: int) -> bytes:
        """The bytes one token adds to the output: control tokens and media markers render as
        nothing (see _MEDIA_MARKER)."""
        cached = self._pieces.get(token)
        if cached is None:
            n = L.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, False)
            if n < 0:
                big = ctypes.create_string_buffer(-n)
                n = L.llama_token_to_piece(self.vocab, token, big, -n, 0, False)
                cached = big.raw[:n]
            else:
                cached = self._piece_buf.raw[:n]
            if _MEDIA_MARKER.fullmatch(cached) and L.llama_vocab_get_attr(self.vocab, token) & L.LLAMA_TOKEN_ATTR_USER_DEFINED:
                cached = b""
            self._pieces[token] = cached
        return cached

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        arr = (L.llama_token * max(len(tokens), 1))(*tokens)
        cap = max(64, len(tokens) * 16)
        buf = ctypes.create_string_buffer(cap)
        n = L.llama_detokenize(self.vocab, arr, len(tokens), buf, cap, False, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_detokenize(self.vocab, arr, len(tokens), buf, -n, False, special)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    def is_control(self, token: int) -> bool:
        return bool(L.llama_vocab_is_control(self.vocab, token))

    # --- compute --------------------------------------------------------------------------------
    def new_batch(self, capacity: int) -> TokenBatch:
        return Batch(capacity, self.n_seq_max)

    def decode(self, batch: TokenBatch) -> None:
        assert isinstance(batch, Batch), "a llama.cpp batch comes from new_batch"
        rc = L.llama_decode(self.ctx, batch.native())
        if rc != 0:
            raise DecodeError(f"llama_decode failed ({rc}): " + (_log_lines[-1].strip() if _log_lines else ""))

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
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None


class Vocabulary(LlamaBackend):
    """llama.cpp's tokenizer alone (a vocabulary-only GGUF): the text half of LlamaBackend."""

    def __init__(self, path: Path):  # not super().__init__: that loads weights and a context
        _ensure_backend()
        self.path = path
        self.ctx = None
        params = L.llama_model_default_params()
        params.vocab_only = True
        self.model = L.llama_model_load_from_file(os.fsencode(path), params)
        if not self.model:
            raise ModelFormatError(f"cannot read the vocabulary {path}; export the model again")
        self._read_vocab()


class MediaChunk:
    """One image (or audio) chunk of a tokenized prompt, owned: a copy of mtmd's chunk, freed with
    this object (the chunk list it came from is freed at once)."""

    def __init__(self, M, ctx, native):
        self.native = native
        #: its cells attend to each other both ways (Gemma 3): one ubatch, never cut
        self.non_causal = bool(M.mtmd_decode_use_non_causal(ctx, native))
        self.kind = "audio" if M.mtmd_input_chunk_get_type(native) == M.MTMD_INPUT_CHUNK_TYPE_AUDIO else "image"
        #: embeddings it puts in the sequence (cells), and positions it takes (M-RoPE: fewer)
        self.n_tokens = M.mtmd_input_chunk_get_n_tokens(native)
        self.n_pos = M.mtmd_input_chunk_get_n_pos(native)
        self.id = (M.mtmd_input_chunk_get_id(native) or b"").decode()
        self._finalizer = weakref.finalize(self, M.mtmd_input_chunk_free, native)


class MediaContext:
    """libmtmd on a LlamaBackend's model: a projector (mmproj GGUF) that turns images into the
    text model's embeddings. Imported on first use, so a text-only engine never loads libmtmd.
    Close it before the backend: it reads the backend's model."""

    def __init__(self, backend: LlamaBackend, path: Path):
        import llama_cpp.mtmd_cpp as M

        self._M = M
        self._backend = backend
        # mtmd and clip log to stderr by default; keep their lines for the error below
        M.mtmd_helper_log_set(_log_callback, ctypes.c_void_p(0))
        params = M.mtmd_context_params_default()
        params.n_threads = L.llama_n_threads(backend.ctx)
        params.print_timings = False
        _log_lines.clear()
        ctx = M.mtmd_init_from_file(os.fsencode(path), backend.model, params)
        if not ctx:
            raise ModelFormatError(f"cannot load the projector {Path(path).name}: {_mtmd_failure_reason()}")
        self.ctx = ctx
        self.vision = bool(M.mtmd_support_vision(ctx))
        self.audio = bool(M.mtmd_support_audio(ctx))
        #: positions in several dimensions (Qwen2-VL's M-RoPE): an image takes fewer positions
        #: than cells
        self.mrope = bool(M.mtmd_decode_use_mrope(ctx))
        #: the text that stands for one picture or sound in a prompt
        self.marker = M.mtmd_default_marker().decode()

    def bitmap(self, data: bytes, ident: str):
        """A decoded image (PNG, JPEG, what stb_image reads) or sound, its id set to `ident` (its
        chunk will carry it); None if mtmd cannot read it. Free it with `free_bitmap`."""
        M = self._M
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
        if bitmap:
            M.mtmd_bitmap_set_id(bitmap, ident.encode())
        return bitmap

    def bitmap_info(self, bitmap) -> tuple[int, int, bool]:
        """Width, height (pixels; samples and 1 for a sound) and whether it is a sound."""
        M = self._M
        return M.mtmd_bitmap_get_nx(bitmap), M.mtmd_bitmap_get_ny(bitmap), bool(M.mtmd_bitmap_is_audio(bitmap))

    def free_bitmap(self, bitmap) -> None:
        self._M.mtmd_bitmap_free(bitmap)

    def tokenize(self, text: str, bitmaps: list, add_special: bool = True) -> list[list[int] | MediaChunk]:
        """The prompt as chunks: token ids for text, a MediaChunk where a marker stood (markers
        and bitmaps in the same order). Special tokens in the text are parsed; with
        `add_special`, BOS is added as the model asks. Raises ValueError with mtmd's reason."""
        M = self._M
        raw = text.encode()
        inp = M.mtmd_input_text(raw, len(raw), add_special, True)
        arr = (M.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
        chunks = M.mtmd_input_chunks_init()
        try:
            rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc == 1:
                raise ValueError("the prompt's media markers and its images differ in number")
            if rc != 0:
                raise ValueError(f"the image could not be prepared for the projector ({_mtmd_failure_reason()})")
            out: list[list[int] | MediaChunk] = []
            n = ctypes.c_size_t()
            for i in range(M.mtmd_input_chunks_size(chunks)):
                chunk = M.mtmd_input_chunks_get(chunks, i)
                if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    ids = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    out.append(ids[: n.value])
                else:
                    out.append(MediaChunk(M, self.ctx, M.mtmd_input_chunk_copy(chunk)))
            return out
        finally:
            M.mtmd_input_chunks_free(chunks)

    def encode(self, chunk: MediaChunk) -> np.ndarray:
        """The chunk's embeddings, (n_tokens, the text model's input width), float32, copied out
        of mtmd's buffer. Runs the projector only (not the text model's context), so it may run
        on another thread while the engine decodes; one encode at a time per MediaContext."""
        M = self._M
        if M.mtmd_encode_chunk(self.ctx, chunk.native) != 0:
            raise DecodeError(f"mtmd could not encode the {chunk.kind}: {_mtmd_failure_reason()}")
        shape = (chunk.n_tokens, L.llama_model_n_embd_inp(self._backend.model))
        return np.ctypeslib.as_array(M.mtmd_get_output_embd(self.ctx), shape).copy()

    def decode(self, chunk: MediaChunk, embeddings: np.ndarray, pos: int, seq: int) -> int:
        """Decode `encode`'s embeddings into sequence `seq` from position `pos`, in batches of the
        context's size, with the chunk's positions (M-RoPE included) and attention (non-causal
        where the model wants it); returns the position after it. Asks no logits."""
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        new_pos = L.llama_pos(pos)
        rc = self._M.mtmd_helper_decode_image_chunk(
            self.ctx,
            self._backend.ctx,
            chunk.native,
            embeddings.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            pos,
            seq,
            self._backend.n_batch,
            ctypes.byref(new_pos),
            self._M.mtmd_helper_post_decode_callback(),  # a NULL one: nothing to do after each batch
            None,
        )
        if rc != 0:
            raise DecodeError(f"llama.cpp could not decode the {chunk.kind}'s embeddings ({rc}): {_mtmd_failure_reason()}")
        return new_pos.value

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._M.mtmd_free(self.ctx)
            self.ctx = None


def _mtmd_failure_reason() -> str:
    for line in reversed("".join(_log_lines).splitlines()):
        if "error" in line.lower() or "mismatch" in line.lower() or "failed" in line.lower():
            return line.strip()
    return "libmtmd could not read it; the file may be damaged or made for another model"
