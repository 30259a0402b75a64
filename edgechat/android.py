"""Android (Termux): what differs there, and the fix that lets llama_cpp load at all.

Termux's Python (3.13+) reports `sys.platform == "android"`. llama-cpp-python 0.3.36's library
loader (`llama_cpp._ctypes_extensions.load_shared_library`) knows only linux, freebsd, darwin,
win32 and emscripten, and raises "Unsupported platform" before it even reads
LLAMA_CPP_LIB_PATH. Android is Linux underneath and the library is the same `libllama.so`, so
while (and only while) a module of the `llama_cpp` package first executes, `sys.platform` reads "linux".
`install_import_shim()` runs when edgechat is imported, and does nothing off Android.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

ANDROID = "android"


def on_android() -> bool:
    # Python before 3.13 on Termux said "linux": its PREFIX still gives Termux away
    return sys.platform == ANDROID or termux_prefix() is not None


def termux_prefix() -> Path | None:
    """Termux's $PREFIX (…/com.termux/files/usr), None outside Termux."""
    prefix = os.environ.get("PREFIX", "")
    return Path(prefix) if "/com.termux/" in prefix else None


class _AsLinuxLoader(importlib.abc.Loader):
    """Runs the wrapped loader with sys.platform reading "linux" for the duration."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        saved = sys.platform
        sys.platform = "linux"
        try:
            # the package's __init__ imports llama_cpp.llama_cpp, which loads libllama.so: all inside
            self.inner.exec_module(module)
        finally:
            sys.platform = saved


class _LlamaCppFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        # the package and its submodules: llama_cpp._ggml, for one, loads libggml when first imported
        if name != "llama_cpp" and not name.startswith("llama_cpp."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _AsLinuxLoader(spec.loader)
        return spec


def install_import_shim() -> bool:
    """On Android, make llama_cpp's modules see a platform their loader knows when imported. Returns
    whether the shim is in place (False elsewhere, and when llama_cpp was imported already)."""
    if sys.platform != ANDROID or "llama_cpp" in sys.modules:
        return False
    if not any(isinstance(f, _LlamaCppFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LlamaCppFinder())
    return True


def _getprop(name: str) -> str:
    try:
        return subprocess.run(["getprop", name], capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def report() -> list[str]:
    """`edgechat doctor`'s Android lines: Termux, the process killer, wake lock, storage."""
    lines = []
    release, sdk = _getprop("ro.build.version.release"), _getprop("ro.build.version.sdk")
    termux = os.environ.get("TERMUX_VERSION")
    where = f"Termux {termux}" if termux else ("Termux" if termux_prefix() else "not Termux")
    lines.append(f"Android {release or '(version unknown)'}{f' (API {sdk})' if sdk else ''}, {where}"
                 f"{f', prefix {termux_prefix()}' if termux_prefix() else ''}")
    if not sdk.isdigit() or int(sdk) >= 31:
        lines.append("  Android 12+ stops Termux's background processes past a limit (the phantom process killer): "
                     "keep Termux in front during long answers, or turn it off in Developer options "
                     "('Disable child process restrictions') or with "
                     "`adb shell settings put global settings_enable_monitor_phantom_procs false`")
    lines.append("  Long answers with the screen off: run `termux-wake-lock` first (`termux-wake-unlock` after)")
    storage = Path.home() / "storage"
    if storage.is_dir():
        lines.append(f"  Shared storage: linked at {storage} (a .gguf in Download/ is {storage}/downloads/NAME.gguf)")
    else:
        lines.append("  Shared storage: not linked; run `termux-setup-storage` to open .gguf files from Download/")
    return lines
