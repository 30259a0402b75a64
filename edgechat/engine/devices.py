"""What the installed llama.cpp can compute on: its backends (CPU, CUDA, Metal, Vulkan, OpenCL,
RPC...) and their devices with free memory, from ggml's own device registry.

llama-cpp-python 0.3.36 binds none of ggml's backend functions, so the few needed are declared
here on the libggml it already loaded.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

#: enum ggml_backend_dev_type, in ggml-backend.h's order
_DEV_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")


@functools.cache
def _ggml() -> ctypes.CDLL:
    from llama_cpp import _ggml

    lib = _ggml.libggml
    for name, res, args in (
        ("ggml_backend_reg_count", ctypes.c_size_t, []),
        ("ggml_backend_reg_get", ctypes.c_void_p, [ctypes.c_size_t]),
        ("ggml_backend_reg_name", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_backend_dev_count", ctypes.c_size_t, []),
        ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
        ("ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_backend_dev_description", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p]),
        ("ggml_backend_dev_memory", None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


@dataclass(frozen=True)
class Device:
    name: str  # ggml's name: CPU, CUDA0, Vulkan0, RPC[host:port]...
    description: str
    kind: str  # cpu, gpu, igpu, accel
    free: int
    total: int

    @property
    def offloads(self) -> bool:
        """Layers can be put on it (llama.cpp offloads to GPUs, integrated ones included)."""
        return self.kind in ("gpu", "igpu")


def backends() -> list[str]:
    """The backends compiled into (or loaded by) this llama.cpp, e.g. ['CPU'] or ['CUDA', 'CPU']."""
    lib = _ggml()
    return [lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode() for i in range(lib.ggml_backend_reg_count())]


def devices() -> list[Device]:
    lib = _ggml()
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = lib.ggml_backend_dev_type(dev)
        found.append(Device(lib.ggml_backend_dev_name(dev).decode(), (lib.ggml_backend_dev_description(dev) or b"").decode(),
                            _DEV_KINDS[kind] if 0 <= kind < len(_DEV_KINDS) else "other", free.value, total.value))
    return found


def gpu_devices() -> list[Device]:
    return [d for d in devices() if d.offloads]
