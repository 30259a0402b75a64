"""Requantizing an existing GGUF with llama.cpp's own quantizer (opt-in: quality suffers)."""

from __future__ import annotations

import ctypes
import os
import tempfile
from pathlib import Path

from quantize.errors import QuantizeError
from quantize.mixture import file_type


def requantize(src: Path, out: Path, type_name: str, threads: int | None = None) -> Path:
    import llama_cpp

    from quantize.llm import _llama

    _llama()  # silences llama.cpp's per-tensor log
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(file_type(type_name).ftype)
    params.nthread = threads or os.cpu_count() or 1
    params.allow_requantize = True
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    os.close(fd)
    try:
        if llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(), ctypes.byref(params)) != 0:
            raise QuantizeError(f"llama.cpp could not requantize {src}")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out
