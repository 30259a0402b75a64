"""`edgechat run`, `models`, `doctor` as a user runs them: real processes, real model, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def edgechat(*args, stdin: str | None = None, env_extra: dict | None = None, timeout: int = 300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "edgechat", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("edgechat: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_version_and_help():
    out = edgechat("--version")
    assert out.returncode == 0 and "edgechat" in out.stdout
    for cmd in ("run", "models", "doctor", "sessions"):
        proc = edgechat(cmd, "--help")
        assert proc.returncode == 0 and "Usage" in proc.stdout


def test_run_json_answers_offline(isolated_dirs):
    proc = edgechat("run", "--json", "--temperature", "0", "--max-tokens", "16", "--threads", "2",
                    "What is the capital of France? Answer in one word.", env_extra={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert "Paris" in data["text"]
    assert data["model"] == "smollm2-135m-instruct"
    assert data["finish_reason"] == "stop"
    for key in ("prompt_tokens", "completion_tokens", "ttft_ms", "prefill_tps", "decode_tps"):
        assert data[key] > 0, key


def test_run_reads_stdin_and_streams_text():
    proc = edgechat("run", "--temperature", "0", "--max-tokens", "12", "-", stdin="What is the capital of France? Answer in one word.")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("bad")
    (root / "notgguf.gguf").write_text("hello, I am not a model\n")
    data = Path(smollm2_path).read_bytes()
    (root / "truncated.gguf").write_bytes(data[: len(data) // 2])
    from gguf import GGUFWriter

    writer = GGUFWriter(str(root / "alien.gguf"), "martian")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (root / "adir").mkdir()
    return root


@pytest.mark.parametrize(
    "args, needles",
    [
        (["-m", "missing.gguf"], ["not found"]),
        (["-m", "{root}/adir"], ["is a directory"]),
        (["-m", "{root}/notgguf.gguf"], ["not a GGUF"]),
        (["-m", "{root}/truncated.gguf"], ["truncated"]),
        (["-m", "{root}/alien.gguf"], ["martian"]),
        (["-m", "smolm2"], ["unknown model", "smollm2"]),
        (["--max-tokens", "-3"], ["--max-tokens"]),
        (["--temperature", "-1"], ["--temperature"]),
        (["--top-p", "2"], ["--top-p"]),
    ],
)
def test_bad_input_gets_one_clear_line(bad_files, args, needles):
    args = [a.replace("{root}", str(bad_files)) for a in args]
    assert_one_line_error(edgechat("run", *args, "hello"), *needles)


def test_empty_prompt_and_prompt_over_the_limit():
    assert_one_line_error(edgechat("run", "  "), "empty")
    proc = edgechat("run", "--ctx", "512", "--max-tokens", "64", "-", stdin="token " * 2000)
    assert_one_line_error(proc, "allows 448", "--ctx")


def test_models_and_doctor_list_both_embedded_models():
    models = edgechat("models")
    assert models.returncode == 0, models.stderr
    assert "smollm2-135m-instruct" in models.stdout and "gemma3-270m" in models.stdout
    assert "Q4_K_M" in models.stdout and "Q4_1" in models.stdout
    doctor = edgechat("doctor")
    assert doctor.returncode == 0, doctor.stderr
    for needle in ("llama-cpp-python 0.3.36", "physical cores", "RAM", "KV/TOKEN", "gemma3"):
        assert needle in doctor.stdout, needle
