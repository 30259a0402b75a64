"""Whether llama.cpp's extra CPU buffer types run here, decided by a probe, not by the flags a CPU
lists: the probe's verdict agrees with what the real embedded model does with those buffers; a
child that faults reads as a fault; the verdict is kept per CPU and build, in a file and in the
environment child processes inherit; doctor says which layout runs and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quantize import cpuprobe


def test_the_probe_agrees_with_the_real_model_run_with_those_buffers():
    ok, why = cpuprobe.probe()
    assert why.startswith("probed: ")
    run = subprocess.run([sys.executable, "-m", "edgechat", "run", "Say hi", "--max-tokens", "4"], capture_output=True, text=True,
                         timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, cpuprobe.ENV: "1"})
    assert (run.returncode == 0) == ok, (why, run.returncode, run.stderr[-500:])


def test_a_child_that_faults_is_a_fault():
    ok, why = cpuprobe.probe([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    assert not ok and "fault (SIGSEGV)" in why


@pytest.fixture
def amx_listed(monkeypatch, tmp_path):
    """A CPU that lists AMX (as this machine's may not), its probe counted."""
    monkeypatch.setenv(cpuprobe.ENV, "")  # recorded, so the verdict the test leaves in os.environ is undone
    monkeypatch.delenv(cpuprobe.ENV)
    monkeypatch.setattr(cpuprobe, "_cpu", lambda: ("Test Xeon", ["avx512f", "amx_tile", "amx_int8"]))
    runs = []

    def probe(command=None):
        runs.append(command)
        return False, "probed: they fault (SIGSEGV): plain buffers"

    monkeypatch.setattr(cpuprobe, "probe", probe)
    cpuprobe.verdict.cache_clear()
    yield runs
    cpuprobe.verdict.cache_clear()


def test_the_verdict_is_probed_once_and_kept_for_the_next_process(amx_listed, monkeypatch, isolated_dirs):
    ok, why = cpuprobe.verdict()
    assert not ok and why == "AMX listed, probed: they fault (SIGSEGV): plain buffers" and len(amx_listed) == 1
    assert os.environ[cpuprobe.ENV] == "0"  # child processes inherit it
    kept = json.loads(cpuprobe._cache_file().read_text())
    assert list(kept.values()) == [[False, "probed: they fault (SIGSEGV): plain buffers"]]
    # a new process on the same machine and build reads the file
    monkeypatch.delenv(cpuprobe.ENV)
    cpuprobe.verdict.cache_clear()
    assert cpuprobe.verdict() == (ok, why) and len(amx_listed) == 1


def test_doctor_says_which_layout_runs():
    out = subprocess.run([sys.executable, "-m", "edgechat", "doctor"], capture_output=True, text=True, timeout=300)
    line = next(line for line in out.stdout.splitlines() if line.startswith("CPU weight layouts: "))
    ok, why = cpuprobe.verdict()
    assert line == f"CPU weight layouts: {'repacked (extra buffer types)' if ok else 'plain'}: {why}"
