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
    proc = edgechat("run", "--json", "--temperature", "0", "--max-tokens", "16",
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


def test_cli_modules_import_each_other_without_a_circle():
    """Command modules may share helpers, never import each other both ways (even lazily)."""
    import ast

    import edgechat.cli

    root = Path(edgechat.cli.__file__).parent
    graph = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            deps |= {n.split(".")[2] for n in names if n.startswith("edgechat.cli.") and n.count(".") == 2}
        graph[path.stem] = deps - {path.stem}

    def reaches(start, goal, seen=()):
        return any(d == goal or (d not in seen and reaches(d, goal, (*seen, d))) for d in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []


def _run_json(*args):
    proc = edgechat("run", "--json", "--temperature", "0", "--max-tokens", "8", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_run_raw_continues_plain_text_on_a_base_model(gemma3_path):
    """Gemma 3 270M is a base model: continued as text it knows the answer; wrapped in a chat
    turn it does not. The template's tokens show in the prompt count."""
    prompt = "The Eiffel Tower is in the city of"
    raw, raw_err = _run_json("--raw", "-m", str(gemma3_path), prompt)
    chat, chat_err = _run_json("-m", str(gemma3_path), prompt)
    assert "Paris" in raw["text"], raw["text"]
    # <start_of_turn>user\n ... <end_of_turn>\n<start_of_turn>model\n around the same text
    assert chat["prompt_tokens"] == raw["prompt_tokens"] + 8
    assert chat["text"] != raw["text"]
    # no template is used, so none is warned about
    assert "warning" in chat_err and "warning" not in raw_err


def test_raw_has_no_roles_to_fill():
    assert_one_line_error(edgechat("run", "--raw", "--session", "s", "hello"), "--raw", "--session")
    assert_one_line_error(edgechat("run", "--raw", "--system", "Be brief.", "hello"), "--raw", "--system")


def test_session_turns_are_stored_listed_and_removed(isolated_dirs):
    first, _ = _run_json("--session", "work", "--system", "Answer in one word.", "What is the capital of France?")
    second, _ = _run_json("--session", "work", "And of Italy?")
    assert first["session"] == second["session"] == "work"
    # the second turn starts from the first one's cache: only the new question is prefilled
    assert second["cached_tokens"] >= first["prompt_tokens"]
    listing = edgechat("sessions")
    assert listing.returncode == 0, listing.stderr
    header, row = listing.stdout.splitlines()
    assert header.split() == ["ID", "NAME", "MESSAGES", "UPDATED", "TITLE"]
    assert row.split()[1:3] == ["work", "4"]
    removed = edgechat("sessions", "rm", "work")
    assert removed.returncode == 0 and removed.stdout.strip() == "deleted work"
    assert "no sessions yet" in edgechat("sessions").stdout
    assert_one_line_error(edgechat("sessions", "rm", "work"), "no session named 'work'")


def test_a_split_gguf_runs_like_the_whole_file(smollm2_path, smollm2_split, tmp_path):
    """Given its first part, llama.cpp reads every part: the same greedy answer as the one file.
    The parts are links to blobs with other names, as in the Hugging Face cache."""
    for i, part in enumerate(smollm2_split):
        (tmp_path / "blobs").mkdir(exist_ok=True)
        os.link(part, tmp_path / "blobs" / f"blob{i}")
        (tmp_path / part.name).symlink_to(tmp_path / "blobs" / f"blob{i}")
    question = "What is the capital of France? Answer in one word."
    whole, _ = _run_json("-m", str(smollm2_path), "--max-tokens", "16", question)
    split, _ = _run_json("-m", str(tmp_path / smollm2_split[0].name), "--max-tokens", "16", question)
    assert split["text"] == whole["text"] and "Paris" in split["text"]
    assert split["model"] == "smollm2"


def test_a_split_gguf_is_described_by_all_its_parts(smollm2_path, smollm2_split, isolated_dirs):
    from edgechat.models import read_model_info

    whole, first = read_model_info(smollm2_path), read_model_info(smollm2_split[0])
    assert first.size_bytes == sum(p.stat().st_size for p in smollm2_split) > smollm2_split[0].stat().st_size
    assert (first.n_params, first.architecture, first.quant) == (whole.n_params, whole.architecture, whole.quant)
    # in the models cache it is listed once, by its first part, at its whole size
    isolated_dirs.models_cache.mkdir(parents=True)
    for part in smollm2_split:
        (isolated_dirs.models_cache / part.name).symlink_to(part)
    listing = edgechat("models")
    assert listing.returncode == 0, listing.stderr
    rows = [line for line in listing.stdout.splitlines() if line.startswith("smollm2-0000")]
    assert len(rows) == 1 and rows[0].split()[:3] == ["smollm2-00001-of-00002", "94", "MiB"], listing.stdout


def test_a_split_gguf_named_by_another_part_or_missing_one_is_one_line(smollm2_split, tmp_path):
    assert_one_line_error(edgechat("run", "-m", str(smollm2_split[1]), "hello"),
                          "part 2 of 2", smollm2_split[0].name)
    alone = tmp_path / smollm2_split[0].name
    os.link(smollm2_split[0], alone)  # not a symlink: the path is resolved, and its target has company
    assert_one_line_error(edgechat("run", "-m", str(alone), "hello"), "part 1 of 2", "missing", smollm2_split[1].name)


def test_run_speculative_modes_give_the_same_text_and_report_their_guesses(isolated_dirs):
    text = "Repeat exactly, twice: the quick brown fox jumps over the lazy dog near the river bank."
    runs = {}
    for mode in ("off", "lookup"):
        proc = edgechat("run", "--json", "--temperature", "0", "--max-tokens", "40",
                        "--speculative", mode, text)
        assert proc.returncode == 0, proc.stderr
        runs[mode] = json.loads(proc.stdout)
    assert runs["lookup"]["text"] == runs["off"]["text"]
    assert runs["off"]["drafted_tokens"] == 0 and runs["off"]["acceptance"] is None
    assert runs["lookup"]["drafted_tokens"] >= runs["lookup"]["accepted_tokens"] > 0
    assert 0 < runs["lookup"]["acceptance"] <= 1
    bad = edgechat("run", "--speculative", "fast", "hi")
    assert bad.returncode == 2 and "fast" in bad.stderr and "Traceback" not in bad.stderr
