"""A turn that meets a full disk or a SIGKILL: `edgechat run --session` as a real process on the
real model; the store is read back afterwards and the next turn's prompt is counted by the engine."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from edgechat.engine import Engine, EngineConfig
from edgechat.engine.types.request import ChatRequest
from edgechat.store import Store
from edgechat.store.history import model_messages
from tests.test_cli import assert_one_line_error, edgechat


def turn(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "edgechat", "run", "--session", "s", "--temperature", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def stored(paths) -> list[tuple[str, str, str]]:
    store = Store.connect(paths.database)
    try:
        assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        (conv,) = store.list_conversations()
        return [(m.role, m.status, m.content) for m in store.messages(conv.id)]
    finally:
        store.close()


def fill(directory) -> str:
    """Fill the file system holding `directory` to the last byte; returns the filler's path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return path


@pytest.fixture
def small_disk(isolated_dirs, tmp_path):
    """The data directory on its own 8 MB tmpfs (the model's cache and the config stay off it)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    data = isolated_dirs.data
    data.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(data)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        for name in ("cache", "config"):
            (tmp_path / name).mkdir()
            (data / name).symlink_to(tmp_path / name)
        yield isolated_dirs
    finally:
        subprocess.run(["umount", "-l", str(data)], check=False)


def test_a_disk_that_fills_during_a_turn_is_one_line_and_loses_nothing(small_disk):
    first = turn("--max-tokens", "8", "Name a color.")
    assert first.wait(timeout=300) == 0, first.stderr.read()
    proc = turn("--ignore-eos", "--max-tokens", "300", "Tell me a long story.")
    printed = proc.stdout.read1(64)
    filler = fill(small_disk.data)
    out, err = proc.communicate(timeout=300)
    printed = (printed + out).decode()
    proc.stderr = err.decode()
    assert_one_line_error(proc, f"the disk holding {small_disk.data} is full (0 KB free, about ", "KB needed); free some space")
    # everything generated was printed (300 tokens), though the store could not take it
    assert len(printed) > 300
    os.unlink(filler)
    q1, a1, q2, a2 = stored(small_disk)
    assert (q1[0], a1[0], a1[1]) == ("user", "assistant", "complete")
    # the question and the answer as of its last save, marked interrupted
    assert q2 == ("user", "complete", "Tell me a long story.")
    assert a2[:2] == ("assistant", "interrupted") and a2[2] and printed.startswith(a2[2])
    again = turn("--max-tokens", "8", "Name a fruit.")
    assert again.wait(timeout=300) == 0, again.stderr.read()
    assert [m[1] for m in stored(small_disk)[-2:]] == ["complete", "complete"]


def test_a_full_disk_before_a_turn_stores_nothing(small_disk):
    first = turn("--max-tokens", "8", "Name a color.")
    assert first.wait(timeout=300) == 0, first.stderr.read()
    filler = fill(small_disk.data)
    assert_one_line_error(edgechat("run", "--session", "s", "--max-tokens", "8", "Name a fruit."),
                          f"the disk holding {small_disk.data} is full")
    os.unlink(filler)
    assert [m[2] for m in stored(small_disk) if m[0] == "user"] == ["Name a color."]


@pytest.fixture(scope="module")
def counter(smollm2_path, models_root):
    """The engine that counts a prompt's tokens as the CLI's engine builds them."""
    with Engine(EngineConfig(model=str(smollm2_path), n_ctx=2048, paths=models_root)) as engine:
        yield lambda messages: engine.count_tokens(ChatRequest(messages=messages))


def next_turn_prompt_tokens(question: str) -> int:
    proc = edgechat("run", "--session", "s", "--json", "--temperature", "0", "--max-tokens", "4", question)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["prompt_tokens"]


def test_a_turn_killed_after_its_first_text_keeps_it_interrupted_and_in_the_next_prompt(isolated_dirs, counter):
    proc = turn("--ignore-eos", "--max-tokens", "400", "Tell me a long story.")
    printed = proc.stdout.read1(64).decode(errors="ignore")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    q, a = stored(isolated_dirs)
    assert q == ("user", "complete", "Tell me a long story.")
    assert a[:2] == ("assistant", "interrupted") and a[2]
    assert printed.startswith(a[2]) or a[2].startswith(printed)
    expected = [{"role": "user", "content": q[2]}, {"role": "assistant", "content": a[2]},
                {"role": "user", "content": "Name a fruit."}]
    assert next_turn_prompt_tokens("Name a fruit.") == counter(expected)


def test_a_turn_killed_before_any_answer_leaves_its_question_out_of_the_next_prompt(isolated_dirs, counter):
    # a long question: its prefill is the window in which the turn is killed
    question = "Summarize this. " + " ".join(f"item {i} is blue;" for i in range(600))
    proc = turn("--max-tokens", "50", question)
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline and proc.poll() is None
        try:
            db = sqlite3.connect(f"file:{isolated_dirs.database}?mode=ro", uri=True)
            rows = db.execute("SELECT role, status, content FROM messages ORDER BY id").fetchall()
            db.close()
        except sqlite3.Error:
            rows = []
        if rows:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert stored(isolated_dirs) == [("user", "complete", question), ("assistant", "interrupted", "")]
    assert next_turn_prompt_tokens("Name a fruit.") == counter([{"role": "user", "content": "Name a fruit."}])
    store = Store.connect(isolated_dirs.database)
    try:
        (conv,) = store.list_conversations()
        assert model_messages(store, conv.id)[0] == {"role": "user", "content": "Name a fruit."}
    finally:
        store.close()
