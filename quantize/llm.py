"""Running a GGUF for the quality report, through llama-cpp-python's low-level bindings.

The quantizer does not depend on the edgechat app (house rule), so it drives llama.cpp itself:
load, tokenize, and evaluate one sequence batch by batch with logits for every position.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from quantize.errors import QuantizeError

if TYPE_CHECKING:
    import llama_cpp

_backend_ready = False


def _llama():
    global _backend_ready
    import llama_cpp

    if not _backend_ready:
        # llama.cpp logs every tensor on load; the report prints its own table
        llama_cpp.llama_log_set(_SILENT, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True
    return llama_cpp


def _silent(level, text, user_data):
    return None


try:
    import llama_cpp as _lc

    _SILENT: object | None = _lc.llama_log_callback(_silent)
except ImportError:  # the report says so when it runs; conversion does not need it
    _SILENT = None


def use_extra_buffers() -> bool:
    """Whether llama.cpp may put weights in its extra CPU buffer types (repacked layouts, AMX
    tiles): where they run, which quantize/cpuprobe.py finds out (EDGECHAT_EXTRA_BUFFERS=1 or 0
    decides without it)."""
    from quantize.cpuprobe import verdict

    return verdict()[0]


class Model:
    """A GGUF loaded for evaluation: `tokenize` and `logits` for one sequence."""

    def __init__(self, path: str | os.PathLike, n_ctx: int = 512, n_batch: int = 64, threads: int | None = None,
                 vocab_only: bool = False, eval_callback=None):
        lc = _llama()
        self._lc = lc
        self.path = Path(path)
        self.ctx = None
        self._batch: llama_cpp.llama_batch | None = None
        mparams = lc.llama_model_default_params()
        mparams.vocab_only = vocab_only
        mparams.use_extra_bufts = use_extra_buffers()
        self.model = lc.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise QuantizeError(f"llama.cpp cannot load {self.path}; is it a complete GGUF?")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        if vocab_only:
            return
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = threads or os.cpu_count() or 1
        if eval_callback is not None:  # a ggml_backend_sched_eval_callback, kept alive by the caller
            cparams.cb_eval = eval_callback
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise QuantizeError(f"llama.cpp cannot create a context for {self.path}")
        self.n_ctx = n_ctx
        self.n_batch = n_batch

    def close(self) -> None:
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            self._lc.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self._lc.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def bos(self) -> int | None:
        """The BOS token, if this vocabulary starts a sequence with one."""
        return self._lc.llama_vocab_bos(self.vocab) if self._lc.llama_vocab_get_add_bos(self.vocab) else None

    def chat_template(self) -> str | None:
        raw = self._lc.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8") if raw else None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 16
        buf = (self._lc.llama_token * size)()
        n = self._lc.llama_tokenize(self.vocab, data, len(data), buf, size, add_special, parse_special)
        if n < 0:
            size = -n
            buf = (self._lc.llama_token * size)()
            n = self._lc.llama_tokenize(self.vocab, data, len(data), buf, size, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self._lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)]

    def logits(self, tokens: list[int]):
        """Yield (start, logits) for consecutive batches: logits[i] predicts tokens[start + i + 1]."""
        for start, n in self.decode(tokens):
            ptr = self._lc.llama_get_logits(self.ctx)
            yield start, np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab)).copy()

    def decode(self, tokens: list[int]):
        """Evaluate `tokens` as one fresh sequence, batch by batch, every position with logits;
        yield (start, n) after each batch while its logits are readable."""
        if len(tokens) > self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens do not fit a context of {self.n_ctx}")
        self.reset()
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            self._decode(chunk, start, all_logits=True)
            yield start, len(chunk)

    def reset(self) -> None:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self.ctx), True)

    def feed(self, tokens: list[int], pos: int) -> np.ndarray:
        """Append `tokens` at positions pos.. of the sequence; the logits after the last one."""
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            self._decode(chunk, pos + start, all_logits=False)
        ptr = self._lc.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def _decode(self, chunk: list[int], pos: int, all_logits: bool) -> None:
        lc = self._lc
        if pos + len(chunk) > self.n_ctx:
            raise QuantizeError(f"{pos + len(chunk)} tokens do not fit a context of {self.n_ctx}")
        if self._batch is None:
            self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        batch = self._batch
        batch.n_tokens = len(chunk)
        for i, tok in enumerate(chunk):
            batch.token[i] = tok
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == len(chunk) - 1
        if lc.llama_decode(self.ctx, batch) != 0:
            raise QuantizeError(f"llama.cpp failed to evaluate {self.path.name}")
