"""llama.cpp's own choice of tensor types, through llama-cpp-python, as the reference for tests.

llama_model_quantize takes the same inputs as llama-quantize's options (file type, importance
data per weight, --tensor-type patterns, output and token-embedding types) as C structs.
"""

from __future__ import annotations

import ctypes
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from quantize.mixture import FILE_TYPES


@contextmanager
def _params(type_name: str, weights: dict[str, np.ndarray] | None, tensor_types, output, token_embedding, threads):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(FILE_TYPES[type_name].ftype)
    params.nthread = threads
    if output is not None:
        params.output_tensor_type = int(output)
    if token_embedding is not None:
        params.token_embedding_type = int(token_embedding)
    keep = []  # the C side only borrows these buffers
    if weights is not None:
        entries = (llama_cpp.llama_model_imatrix_data * (len(weights) + 1))()
        for i, (name, w) in enumerate(weights.items()):
            w = np.ascontiguousarray(w, dtype=np.float32)
            keep.append(w)
            entries[i].name = name.encode()
            entries[i].data = w.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = w.size
        params.imatrix = entries
    if tensor_types:
        overrides = (llama_cpp.llama_model_tensor_override * (len(tensor_types) + 1))()
        for i, (pattern, qtype) in enumerate(tensor_types):
            overrides[i].pattern = pattern.encode()
            overrides[i].type = int(qtype)
        params.tt_overrides = overrides
    yield params


_LINE = re.compile(r"\] (\S+)\s+- \[[^\]]*\], type =\s*(\w+), size =[^(\n]*(?:\((\w+)\))?\n")


def llama_types(src: Path, type_name: str, *, weights=None, tensor_types=(), output=None,
                token_embedding=None) -> dict[str, GGMLQuantizationType]:
    """The type llama.cpp gives each tensor, from a dry run's log (no quantization runs)."""
    import llama_cpp

    from quantize.llm import _SILENT, _llama

    _llama()
    log: list[bytes] = []
    capture = llama_cpp.llama_log_callback(lambda level, text, user_data: log.append(text))
    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        with _params(type_name, weights, tensor_types, output, token_embedding, 1) as params:
            params.dry_run = True
            assert llama_cpp.llama_model_quantize(str(src).encode(), b"/nonexistent", ctypes.byref(params)) == 0
    finally:
        llama_cpp.llama_log_set(_SILENT, ctypes.c_void_p(0))
    text = b"".join(log).decode()
    return {name: GGMLQuantizationType[(new or old).upper()] for name, old, new in _LINE.findall(text)}
