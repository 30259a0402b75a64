"""What the installed llama.cpp can compute on: its backends (CPU, CUDA, Metal, Vulkan, OpenCL,
RPC...) and their devices with free memory, from ggml's own device registry; and the remote
devices of llama.cpp's RPC servers (`--rpc host:port,...`).

llama-cpp-python 0.3.36 binds none of ggml's backend functions, so the few needed are declared
here, looked up through libllama's handle: that finds the libggml libllama itself uses, also when
LLAMA_CPP_LIB_PATH names another build than the one llama_cpp._ggml loads.
"""

from __future__ import annotations

import ctypes
import functools
import socket
import sys
from dataclasses import dataclass

from edgechat.errors import UsageError

#: enum ggml_backend_dev_type, in ggml-backend.h's order
_DEV_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")


@functools.cache
def _ggml() -> ctypes.CDLL:
    from llama_cpp import llama_cpp

    lib = llama_cpp._lib
    if sys.platform == "win32":
        # GetProcAddress does not search a DLL's dependencies
        from llama_cpp import _ggml

        lib = _ggml.libggml
    for name, res, args in (
        ("ggml_backend_reg_count", ctypes.c_size_t, []),
        ("ggml_backend_reg_get", ctypes.c_void_p, [ctypes.c_size_t]),
        ("ggml_backend_reg_name", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_backend_reg_by_name", ctypes.c_void_p, [ctypes.c_char_p]),
        ("ggml_backend_reg_get_proc_address", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]),
        ("ggml_backend_register", None, [ctypes.c_void_p]),
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
    """Devices llama.cpp offloads layers to: GPUs, and RPC servers' devices once added."""
    return [d for d in devices() if d.offloads]


#: endpoints already added in this process (llama.cpp would list a server's devices twice)
_rpc_added: set[str] = set()


def add_rpc_servers(endpoints: list[str]) -> None:
    """Make each `host:port` ggml-rpc-server's devices llama.cpp devices, as llama.cpp's own
    --rpc does: layers offloaded then go to them too (split by their free memory)."""
    lib = _ggml()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise UsageError("this llama.cpp has no RPC backend; reinstall llama-cpp-python with "
                         "CMAKE_ARGS=\"-DGGML_RPC=ON\" (packaging/GPU.md, several machines)")
    address = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(address)
    for endpoint in endpoints:
        if endpoint in _rpc_added:
            continue
        host, _, port = endpoint.rpartition(":")
        try:
            # llama.cpp aborts the whole process when it cannot connect: ask first
            socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
        except OSError as exc:
            raise UsageError(f"no ggml-rpc-server answers at {endpoint} ({exc.strerror or exc}); "
                             "start one there (ggml-rpc-server -H HOST -p PORT)") from None
        server = add_server(endpoint.encode())
        if not server:
            raise UsageError(f"no ggml-rpc-server answers at {endpoint}; start one there (ggml-rpc-server -H HOST -p PORT)")
        lib.ggml_backend_register(server)
        _rpc_added.add(endpoint)


def parse_rpc(value: str | None) -> list[str]:
    """`host:port,host:port` -> endpoints; UsageError for anything else."""
    if not value:
        return []
    endpoints = [e.strip() for e in value.split(",") if e.strip()]
    for e in endpoints:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--rpc takes host:port[,host:port...], not '{e}'")
    return endpoints
