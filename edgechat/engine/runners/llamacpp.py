"""llama.cpp the library, process-wide: its backend initialised once, its log kept (not printed)
to explain a failure in one line, its version and build."""

from __future__ import annotations

import ctypes
import threading
from collections import deque

import llama_cpp as L

_init_lock = threading.Lock()
_initialised = False
#: recent llama.cpp log lines, to explain a failed load in one line
_log_lines: deque[str] = deque(maxlen=64)


@L.llama_log_callback
def log_callback(level: int, text: bytes, user_data) -> None:
    # llama.cpp logs a great deal to stderr by default; keep it for error messages instead.
    if text:
        _log_lines.append(text.decode("utf-8", errors="replace"))


def ensure_backend() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            L.llama_log_set(log_callback, ctypes.c_void_p(0))
            L.llama_backend_init()
            _initialised = True


def clear_log() -> None:
    """Forget the lines so far, before a call whose failure the next lines will explain."""
    _log_lines.clear()


def log_text() -> str:
    return "".join(_log_lines)


def last_log_line() -> str:
    return _log_lines[-1].strip() if _log_lines else ""


def load_failure_reason() -> str:
    lines = log_text().splitlines()
    for line in reversed(lines):
        if "unknown model architecture" in line:
            arch = line.rsplit(":", 1)[-1].strip()
            return f"unknown model architecture {arch}; this llama.cpp build cannot run it, pick another model (edgechat models)"
    for line in reversed(lines):
        if "error loading model:" in line:
            return line.split("error loading model:", 1)[1].strip()
    return "llama.cpp could not load it; the file may be damaged or of a newer format"


class DecodeError(RuntimeError):
    pass


def llama_version() -> str:
    return L.__version__


def system_info() -> str:
    ensure_backend()
    return L.llama_print_system_info().decode("utf-8", errors="replace")


def supports_gpu_offload() -> bool:
    ensure_backend()
    return bool(L.llama_supports_gpu_offload())
