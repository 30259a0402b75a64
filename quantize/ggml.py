"""llama.cpp's own quantization kernels, called through ctypes on blocks of rows.

`ggml_quantize_chunk` from the libggml-base that llama-cpp-python ships is the function
llama.cpp's quantizer calls per chunk of rows, so the bytes produced here are llama.cpp's
bytes. ctypes releases the GIL during the call, so blocks can be quantized on threads.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quantize.errors import QuantizeError


def _library_names() -> list[str]:
    if sys.platform == "darwin":
        return ["libggml-base.dylib"]
    if sys.platform == "win32":
        return ["ggml-base.dll"]
    return ["libggml-base.so"]


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    # Located through the package's files, not imported: importing llama_cpp loads the whole runtime.
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise QuantizeError("llama-cpp-python is not installed; install edgechat's dependencies to quantize")
    for base in spec.submodule_search_locations:
        for name in _library_names():
            candidate = Path(base) / "lib" / name
            if candidate.is_file():
                lib = ctypes.CDLL(str(candidate))
                lib.ggml_quantize_chunk.restype = ctypes.c_size_t
                lib.ggml_quantize_chunk.argtypes = [
                    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                ]
                lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
                lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
                lib.ggml_validate_row_data.restype = ctypes.c_bool
                lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
                return lib
    raise QuantizeError("llama-cpp-python's libggml-base was not found; reinstall llama-cpp-python")


def row_size(qtype: GGMLQuantizationType, n_per_row: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return n_per_row // block * size


def quantize_rows(qtype: GGMLQuantizationType, rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize a float32 matrix (rows x n_per_row) to `qtype`, weighting each column's error by
    `imatrix` (float32, n_per_row) when given; returns the raw blocks as uint8."""
    if rows.dtype != np.float32 or not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
    nrows, n_per_row = rows.shape
    lib = _lib()
    if imatrix is None and lib.ggml_quantize_requires_imatrix(int(qtype)):
        # ggml aborts the process in this case; callers check first, this keeps it a Python error
        raise QuantizeError(f"{qtype.name} needs an importance matrix (--imatrix)")
    if imatrix is not None and (imatrix.dtype != np.float32 or imatrix.shape != (n_per_row,)):
        raise ValueError(f"imatrix of shape {imatrix.shape} for rows of {n_per_row}")
    out = np.empty(nrows * row_size(qtype, n_per_row), dtype=np.uint8)
    weights = None if imatrix is None else imatrix.ctypes.data
    written = lib.ggml_quantize_chunk(int(qtype), rows.ctypes.data, out.ctypes.data, 0, nrows, n_per_row, weights)
    if written != out.nbytes or not lib.ggml_validate_row_data(int(qtype), out.ctypes.data, out.nbytes):
        raise RuntimeError(f"ggml_quantize_chunk produced invalid {qtype.name} data")
    return out
