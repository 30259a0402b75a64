"""The prompt cache on disk (`serve --cache-disk`): a server stopped with SIGTERM, or killed with
`kill -9` once its background write has had time, answers the same long system prompt from
cache after a restart; files with other tags are left unused, a corrupt or cut-short file is
skipped in one log line, the disk bound removes the least recently used state first, and the
folder is the user's alone (0700). Restarts run `edgechat serve` as a subprocess on the real
Qwen2.5-Coder-0.5B and on SmolLM2; the rest runs on SmolLM2 in-process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from edgechat.cli import cli
from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams

PATIENCE_S = 300
#: a system prompt of ~800 tokens (an agent's instructions and tool list), numbered so no two
#: lines are the same
RULES = [
    f"Rule {i}: when the user asks about topic number {i}, answer with the {('shortest', 'clearest', 'safest', 'kindest')[i % 4]} "
    f"reply you can, name the {('file', 'function', 'module', 'test')[i % 4]} involved, and never invent a detail."
    for i in range(1, 27)
]
SYSTEM = {"role": "system", "content": "You are a coding assistant.\n" + "\n".join(RULES)}
QUESTION = [SYSTEM, {"role": "user", "content": "Which rule covers topic 7?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: Path, data: Path, *args: str):
    """`edgechat serve` on the model in a subprocess; yields (process, base URL). The test ends it
    the way it means to (SIGTERM, SIGKILL); whatever still runs afterwards is killed."""
    port = _free_port()
    cmd = [sys.executable, "-m", "edgechat", "serve", "-m", str(model), "--port", str(port), "--parallel", "2", "--ctx", "2048",
           "--speculative", "off", "--degrade-queue-wait", "0", "--data-dir", str(data), *args]
    log = open(data.parent / f"serve-{port}.log", "w+")  # noqa: SIM115 (read back by the test)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + PATIENCE_S
        while True:
            assert proc.poll() is None, Path(log.name).read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


def ask(url: str, messages: list[dict]) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=PATIENCE_S,
                   json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def prompt_files(data: Path) -> list[Path]:
    return sorted((data / "snapshots" / "prompts").glob("*.kv"))


def wait_for_files(data: Path, n: int) -> list[Path]:
    deadline = time.monotonic() + 60
    while len(files := prompt_files(data)) < n:
        assert time.monotonic() < deadline, f"{len(files)} prompt state files, not {n}"
        time.sleep(0.1)
    return files


def stop(proc: subprocess.Popen, sig: int) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=PATIENCE_S)


def test_a_sigterm_restart_answers_a_long_system_prompt_from_disk_on_the_real_model(qwen_coder_path, tmp_path):
    data = tmp_path / "data"
    with serve(qwen_coder_path, data) as (proc, url):
        cold = ask(url, QUESTION)
        assert cold["prompt_tokens"] >= 800 and cached(cold) == 0, cold
        assert stop(proc, signal.SIGTERM) == 0
    assert prompt_files(data)
    with serve(qwen_coder_path, data) as (proc, url):
        again = ask(url, QUESTION)
        # the whole prompt: its logits were kept with its state, so nothing is prefilled
        assert again["prompt_tokens"] == cold["prompt_tokens"] and cached(again) == again["prompt_tokens"], again
        # another question after the same system prompt starts from its cells too
        other = ask(url, [SYSTEM, {"role": "user", "content": "And topic 12, in one line?"}])
        assert cached(other) >= cold["prompt_tokens"] - 16, other
        assert "Traceback" not in proc.log_path.read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "kill-9"])
def test_a_restart_after_sigint_or_kill_9_answers_from_disk(smollm2_path, tmp_path, sig):
    data = tmp_path / "data"
    with serve(smollm2_path, data) as (proc, url):
        cold = ask(url, QUESTION)
        assert cached(cold) == 0
        if sig == signal.SIGKILL:
            wait_for_files(data, 1)  # written in the background a moment after the answer
        stop(proc, sig)
    with serve(smollm2_path, data) as (proc, url):
        again = ask(url, QUESTION)
        assert cached(again) == again["prompt_tokens"] == cold["prompt_tokens"], again


def test_cache_disk_zero_writes_nothing(smollm2_path, tmp_path):
    data = tmp_path / "data"
    with serve(smollm2_path, data, "--cache-disk", "0") as (proc, url):
        ask(url, QUESTION)
        assert stop(proc, signal.SIGTERM) == 0
    assert prompt_files(data) == []


def test_serve_passes_cache_disk_in_mib_to_the_engine(monkeypatch):
    import edgechat.engine

    seen = []

    class Stop(Exception):
        pass

    def record(config):
        seen.append(config.prompt_cache_disk)
        raise Stop  # the configuration is all this test needs: no model is loaded

    monkeypatch.setattr(edgechat.engine, "open_engine", record)
    for args in ([], ["--cache-disk", "0"], ["--cache-disk", "64"]):
        assert CliRunner().invoke(cli, ["serve", *args]).exit_code != 0
    assert seen == [1024 << 20, 0, 64 << 20]
    result = CliRunner().invoke(cli, ["serve", "--cache-disk", "-1"])
    assert result.exit_code == 2 and "--cache-disk" in result.output


# ---------------------------------------------------------------- in-process, on SmolLM2
PROMPTS = [[{"role": "system", "content": "You answer in one short sentence."}, {"role": "user", "content": f"Say something about {topic}."}]
           for topic in ("a lighthouse", "a kettle", "the market", "a paper boat")]


def engine_for(paths, disk: int = 64 << 20, n_ctx: int = 512) -> Engine:
    return Engine(EngineConfig(model="smollm2-135m-instruct", n_ctx=n_ctx, n_parallel=1, paths=paths,
                               prompt_cache_budget=64 << 20, prompt_cache_disk=disk, speculative="off"))


def answer(engine: Engine, messages: list[dict]):
    req = ChatRequest(messages=messages, sampling=SamplingParams(temperature=0), max_tokens=4, ignore_eos=True)
    return engine.submit(req).result(timeout=PATIENCE_S).metrics


def test_a_corrupt_or_cut_short_file_is_skipped_in_one_line_each(isolated_dirs, caplog):
    with engine_for(isolated_dirs) as engine:
        for p in PROMPTS[:2]:
            answer(engine, p)
    truncated, garbled = wait_for_files(isolated_dirs.data, 2)
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    garbled.write_bytes(b"ECPROMP1" + os.urandom(64))
    caplog.set_level("INFO", logger="edgechat")
    with engine_for(isolated_dirs) as engine:
        metrics = [answer(engine, p) for p in PROMPTS[:2]]
        assert all(m.prompt_cache_hit is not True for m in metrics)
        assert engine.kv_problems() == []
    lines = [r.getMessage() for r in caplog.records if "skipped the prompt cache file" in r.getMessage()]
    assert len(lines) == 2 and all(sum(f.name in line for line in lines) == 1 for f in (truncated, garbled)), lines
    assert not any(r.exc_info for r in caplog.records)


def test_files_of_another_context_are_not_used_nor_removed(isolated_dirs):
    with engine_for(isolated_dirs) as engine:
        answer(engine, PROMPTS[0])
    files = wait_for_files(isolated_dirs.data, 1)
    with engine_for(isolated_dirs, n_ctx=1024) as engine:
        assert answer(engine, PROMPTS[0]).prompt_cache_hit is not True
    assert all(f.exists() for f in files)
    with engine_for(isolated_dirs) as engine:
        assert answer(engine, PROMPTS[0]).prompt_cache_hit is True


def test_the_disk_bound_removes_the_least_recently_used_state(isolated_dirs):
    with engine_for(isolated_dirs) as engine:
        answer(engine, PROMPTS[0])
        answer(engine, PROMPTS[1])  # takes the one sequence: PROMPTS[0]'s state is kept
        first, second = [f.name for f in sorted(wait_for_files(isolated_dirs.data, 2), key=lambda f: f.stat().st_mtime)]
        size = max(f.stat().st_size for f in prompt_files(isolated_dirs.data))
        engine.prompt_cache.store.budget = int(size * 2.5)  # room for two states, not three
        assert answer(engine, PROMPTS[0]).prompt_cache_hit is True  # used again: now the most recent
        answer(engine, PROMPTS[2])  # a third state is written: PROMPTS[1]'s leaves
        deadline = time.monotonic() + 60
        while second in {f.name for f in prompt_files(isolated_dirs.data)}:
            assert time.monotonic() < deadline, "the disk bound removed nothing"
            time.sleep(0.1)
        names = {f.name for f in prompt_files(isolated_dirs.data)}
        assert first in names and len(names) == 2
        assert sum(f.stat().st_size for f in prompt_files(isolated_dirs.data)) <= size * 2.5


def test_the_folder_and_its_files_are_private(isolated_dirs):
    folder = isolated_dirs.snapshots / "prompts"
    folder.mkdir(parents=True, mode=0o755)
    folder.chmod(0o755)  # made by hand, open to all: the engine narrows it
    old = os.umask(0o022)
    try:
        with engine_for(isolated_dirs) as engine:
            answer(engine, PROMPTS[0])
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = wait_for_files(isolated_dirs.data, 1)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


def test_a_folder_that_cannot_be_made_leaves_the_cache_in_ram(isolated_dirs, caplog):
    isolated_dirs.snapshots.mkdir(parents=True)
    (isolated_dirs.snapshots / "prompts").write_text("not a folder")
    with engine_for(isolated_dirs) as engine:
        answer(engine, PROMPTS[0])
        answer(engine, PROMPTS[1])
        assert answer(engine, PROMPTS[0]).prompt_cache_hit is True  # from RAM
    assert [r.getMessage() for r in caplog.records if "stays in RAM" in r.getMessage()]
