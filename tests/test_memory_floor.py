"""The memory floor in a real memory cgroup (v1's memory.limit_in_bytes or v2's memory.max,
writable as root): `edgechat serve` on the embedded model, put in a cgroup of its own whose limit
leaves less free than its floor, sheds in order and says so (the prompt cache's RAM first), then
refuses new requests with a retryable 503 while an answer in progress finishes and the process
lives; with room again it serves as before."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.bench_serve import _free_port
from edgechat import sysmem

FLOOR_MIB = 300


def _own_cgroup() -> tuple[Path, str, str] | None:
    """A new cgroup beside this process's: (folder, limit file name, procs file name)."""
    files = sysmem.cgroup_files()
    if files is None or os.geteuid() != 0:
        return None
    limit, _ = files
    folder = limit.parent / f"edgechat-test-{os.getpid()}"
    try:
        folder.mkdir()
    except OSError:
        return None
    return folder, limit.name, "cgroup.procs"


@pytest.fixture
def cgroup():
    found = _own_cgroup()
    if found is None:
        pytest.skip("needs root and a writable memory cgroup")
    folder, limit, procs = found
    yield folder, limit, procs
    for _ in range(50):
        try:
            folder.rmdir()
            break
        except OSError:
            time.sleep(0.1)


def _usage(folder: Path, limit_name: str) -> int:
    usage = "memory.usage_in_bytes" if limit_name == "memory.limit_in_bytes" else "memory.current"
    return int((folder / usage).read_text())


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(name)


def test_under_the_floor_the_server_sheds_then_refuses_and_lives(cgroup, tmp_path, smollm2_path):
    folder, limit_name, procs = cgroup
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgechat", "serve", "-m", str(smollm2_path), "--port", str(port), "--ctx", "2048",
                                 "--parallel", "2", "--cache-ram", "512", "--memory-floor", str(FLOOR_MIB), "--data-dir", str(tmp_path / "data")],
                                stdout=out, stderr=subprocess.STDOUT)
    (folder / procs).write_text(str(proc.pid))  # before the model loads: its memory is charged here
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        chat = lambda text, n=8: httpx.post(f"{url}/v1/chat/completions", timeout=120, json={  # noqa: E731
            "messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0})
        for i in range(4):  # distinct long prompts: each slot's old prompt goes to the prompt cache
            assert chat(f"Topic {i}: " + f"fact {i} about rivers and mountains. " * 30).status_code == 200
        assert _metric(url, "edgechat_prompt_cache_entries") > 0
        # an answer in progress when memory runs short
        long_answer: dict = {}
        started = threading.Event()

        def answer() -> None:
            with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300, json={
                    "messages": [{"role": "user", "content": "Count from one to five hundred."}], "max_tokens": 64,
                    "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
                started.set()
                long_answer["status"] = resp.status_code
                long_answer["body"] = "".join(resp.iter_text())

        worker = threading.Thread(target=answer)
        worker.start()
        assert started.wait(60)
        # the cgroup's limit now leaves half the floor free
        (folder / limit_name).write_text(str(_usage(folder, limit_name) + (FLOOR_MIB << 20) // 2))
        time.sleep(1.2)
        refused = chat("Hello?")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["error"]["code"] == "memory_low"
        assert httpx.get(f"{url}/health").json()["degraded"] is True  # the degrade switch took memory as its signal
        text = log.read_text()
        shed = text.index("the prompt cache let go of")
        assert shed < text.index("new requests are refused (503, Retry-After)")
        assert _metric(url, "edgechat_prompt_cache_entries") == 0
        worker.join(300)
        assert long_answer["status"] == 200 and "[DONE]" in long_answer["body"]  # not lost
        assert proc.poll() is None  # and not killed
        # room again: served as before
        (folder / limit_name).write_text("-1" if limit_name == "memory.limit_in_bytes" else "max")
        time.sleep(1.2)
        assert chat("Hello again?").status_code == 200
        assert "above the floor of 300 MiB again: back to normal" in log.read_text()
        assert httpx.get(f"{url}/health").json()["degraded"] is False
        assert "degrade switch on (memory: " in log.read_text() and "degrade switch off (memory: " in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
