"""Computing an importance matrix: run the model over calibration text and watch its matmuls.

llama.cpp calls an evaluation callback for every node of the graph it is about to compute
(`ask`), then again once a node it was interested in has been computed. For every matrix
multiplication by a layer weight (`blk.*`) over at least 16 tokens, the callback adds the
squares of the activations entering each input column to that weight's sums and the number of
tokens to its count: what llama-imatrix collects, so the two files agree. Text is cut into
chunks of `n_ctx` tokens, each evaluated from an empty cache with a BOS at its start, as
llama-imatrix does; only dense weights are handled (no MoE family is converted here).
"""

from __future__ import annotations

import ctypes
import os
from importlib.resources import files
from pathlib import Path

import numpy as np

from quantize.errors import QuantizeError
from quantize.imatrix import Imatrix

BUILTIN = "builtin"  # the name the shipped calibration text is recorded under

_MAX_DIMS, _MAX_SRC, _MAX_NAME = 4, 10, 64
_F32 = 0  # GGML_TYPE_F32


class _Tensor(ctypes.Structure):
    """The head of ggml's struct ggml_tensor (ggml.h), as far as the callback reads it."""


_Tensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * _MAX_DIMS),
    ("nb", ctypes.c_size_t * _MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * 16),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(_Tensor) * _MAX_SRC),
    ("view_src", ctypes.POINTER(_Tensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * _MAX_NAME),
]


_OP, _NAME = _Tensor.op.offset, _Tensor.name.offset
_LAST = b"result_norm\0"  # llama.cpp's name for the norm before the output layer, in every family
_c_int = ctypes.c_int


def builtin_text() -> str:
    return files("quantize").joinpath("calibration.txt").read_text(encoding="utf-8")


def _mul_mat_op() -> int:
    from quantize.ggml import _lib

    lib = _lib()
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    for i in range(200):
        if lib.ggml_op_name(i) == b"MUL_MAT":
            return i
    raise RuntimeError("ggml has no MUL_MAT op")


class _Collector:
    def __init__(self):
        from quantize.ggml import _lib

        self.op = _mul_mat_op()
        lib = _lib()
        lib.ggml_backend_buffer_is_host.restype = ctypes.c_bool
        lib.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.lib = lib
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.error: Exception | None = None

    def __call__(self, t_ptr, ask, _user_data):
        try:
            # called for every graph node: look at the op before building any struct view
            if _c_int.from_address(t_ptr + _OP).value != self.op:
                if ctypes.string_at(t_ptr + _NAME, len(_LAST)) == _LAST:
                    # the final norm: every watched matmul is behind us, and returning False after
                    # it stops the graph before the output layer (Gemma: 262k rows, most of the work)
                    return ask
                return not ask
            t = _Tensor.from_address(t_ptr)
            src0, src1 = t.src[0].contents, t.src[1].contents
            name = src0.name.split(b"#")[1] if b"#" in src0.name else src0.name
            if ask:
                return name.startswith(b"blk.") and src1.ne[1] >= 16 and src1.type == _F32
            self._add(name.decode(), src0, src1)
        except Exception as exc:  # an exception cannot cross into C; report it after the decode
            self.error = self.error or exc
        return True

    def _add(self, name: str, src0: _Tensor, src1: _Tensor) -> None:
        ne, nb = list(src1.ne), list(src1.nb)
        extent = sum((n - 1) * s for n, s in zip(ne, nb, strict=True)) + 4
        if self.lib.ggml_backend_buffer_is_host(src1.buffer):
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * extent).from_address(src1.data))
        else:
            raw = np.empty(extent, dtype=np.uint8)
            self.lib.ggml_backend_tensor_get(ctypes.addressof(src1), raw.ctypes.data, 0, extent)
        x = np.lib.stride_tricks.as_strided(raw.view(np.float32) if nb[0] == 4 else raw, shape=ne[::-1],
                                            strides=nb[::-1])
        # activations [i3, i2, rows, cols]; a 2D weight gathers them all
        n_mat = int(src0.ne[2] * src0.ne[3])
        if n_mat != 1:
            raise QuantizeError(f"{name} is a stack of {n_mat} matrices; importance matrices for MoE models are not supported")
        rows = x.reshape(-1, ne[0])
        sq = np.einsum("ij,ij->j", rows, rows)  # float32 per batch, float64 across batches
        if name in self.sums:
            self.sums[name] += sq
        else:
            self.sums[name] = sq.astype(np.float64)
        self.counts[name] = self.counts.get(name, 0) + ne[1] * ne[2] * ne[3]


#: memory the logits of one batch may take: every position needs logits (so the last layer
#: computes every row, as llama-imatrix's does), and a large vocabulary makes them the biggest buffer
LOGITS_BUDGET = 256 * 1024 * 1024


def compute(model_path: str | os.PathLike, text: str, *, dataset: str = BUILTIN, n_ctx: int = 512,
            max_chunks: int | None = None, threads: int | None = None) -> Imatrix:
    """The importance matrix of the GGUF at `model_path` over `text`, in chunks of `n_ctx` tokens."""
    import llama_cpp

    from quantize.llm import Model

    with Model(Path(model_path), vocab_only=True) as vocab:
        tokens = vocab.tokenize(text, add_special=True)
        bos = vocab.bos
        n_vocab = vocab.n_vocab
    if len(tokens) < 2 * n_ctx:
        raise QuantizeError(
            f"the calibration text is {len(tokens)} tokens; it needs at least {2 * n_ctx} (two chunks of {n_ctx})"
        )
    n_chunks = len(tokens) // n_ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    # Each batch is a graph split at every watched matmul, so larger batches cost much less per
    # token (measured: 512 tokens in one batch 1.3x a plain decode, in four 2-3x).
    n_batch = n_ctx
    while n_batch > 64 and n_batch * n_vocab * 4 > LOGITS_BUDGET:
        n_batch //= 2
    collector = _Collector()
    callback = llama_cpp.ggml_backend_sched_eval_callback(collector)
    with Model(Path(model_path), n_ctx=n_ctx, n_batch=n_batch, threads=threads, eval_callback=callback) as model:
        for i in range(n_chunks):
            chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
            if bos is not None:
                chunk[0] = bos
            for _ in model.decode(chunk):
                if collector.error is not None:
                    raise collector.error
    result = Imatrix(datasets=[dataset], chunk_count=n_chunks, chunk_size=n_ctx)
    for name in sorted(collector.sums):
        result.entries[name] = (collector.sums[name].astype(np.float32)[None, :],
                                np.array([collector.counts[name]], dtype=np.float32))
    return result
