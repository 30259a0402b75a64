"""Faults injected into a real engine: whatever breaks (the disk, a callback, llama.cpp's state
calls, the thread itself), every handle gets a Finished within a bound, the queue count returns to
zero, callers never wait forever, and the engine keeps serving or refuses clearly."""

from __future__ import annotations

import errno
import time

import pytest
from conftest import GREEDY

from edgechat.engine import ChatRequest, Engine, EngineConfig, TextDelta
from edgechat.engine.kv import snapshots as snapshots_module
from edgechat.errors import EngineStoppedError

BOUND_S = 30


def engine_for(path, paths, **kw):
    return Engine(EngineConfig(model=str(path), n_ctx=512, paths=paths, **kw))


def ask(engine, text, session=None, **kw):
    kw.setdefault("max_tokens", 8)
    return engine.submit(ChatRequest(messages=[{"role": "user", "content": text}], sampling=GREEDY, session=session, **kw))


def wait_idle(engine):
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the engine did not come back to idle: {engine.stats()}")


def test_a_full_disk_loses_snapshots_not_answers(smollm2_path, isolated_dirs, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshots_module, "atomic_write", disk_full)
    with engine_for(smollm2_path, isolated_dirs) as engine:
        assert ask(engine, "Say hi.", session="a").result(BOUND_S).reason in ("stop", "length")
        engine.release_session("a")  # answers, though nothing could be written
        # another conversation spills "a" (its snapshot fails too) and is served
        assert ask(engine, "Say hello.", session="b").result(BOUND_S).reason in ("stop", "length")
        assert ask(engine, "Say hi.", session="a").result(BOUND_S).metrics.cached_tokens == 0
        assert wait_idle(engine)["waiting"] == 0
        assert engine.kv_problems() == []
    assert not list(isolated_dirs.snapshots.glob("*.kv"))


def test_an_unreadable_snapshot_directory_means_a_cold_turn(smollm2_path, isolated_dirs, monkeypatch):
    with engine_for(smollm2_path, isolated_dirs) as engine:
        ask(engine, "Say hi.", session="a").result(BOUND_S)
        engine.release_session("a")

    def broken(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(snapshots_module.os, "utime", broken)
    with engine_for(smollm2_path, isolated_dirs) as engine:
        # the snapshot is read although its time cannot be touched (a read-only disk)
        assert ask(engine, "Say hi.", session="a").result(BOUND_S).metrics.cached_tokens > 5
        monkeypatch.setattr(snapshots_module, "open", broken, raising=False)
        engine.forget_session("a")  # and a snapshot that cannot be opened is only a cold turn
        assert ask(engine, "Say hi.", session="a").result(BOUND_S).reason in ("stop", "length")


def test_state_seq_get_raising_fails_only_the_request_that_needed_it(smollm2_path, isolated_dirs, monkeypatch):
    with engine_for(smollm2_path, isolated_dirs) as engine:
        ask(engine, "Say hi.", session="a").result(BOUND_S)

        def broken(seq):
            raise RuntimeError("llama_state_seq_get_data failed")

        monkeypatch.setattr(engine.backend, "state_seq_get", broken)
        # "b" needs the only sequence, so "a" must be spilled first: that is what fails
        done = ask(engine, "Say hello.", session="b").result(BOUND_S)
        assert done.reason == "error" and "state_seq_get" in done.error
        assert wait_idle(engine)["waiting"] == 0
        monkeypatch.undo()
        assert ask(engine, "Say hello.", session="b").result(BOUND_S).reason in ("stop", "length")
        assert engine.kv_problems() == []


def test_a_callback_that_raises_cancels_its_request_and_frees_its_sequence(smollm2_path, isolated_dirs):
    with engine_for(smollm2_path, isolated_dirs) as engine:
        def broken(event):
            if isinstance(event, TextDelta):
                raise RuntimeError("a UI that went away")

        handle = engine.submit(ChatRequest(messages=[{"role": "user", "content": "Count to a hundred."}], sampling=GREEDY,
                                           max_tokens=200, ignore_eos=True), on_event=broken)
        done = handle.result(BOUND_S)
        assert done.reason == "cancelled" and done.metrics.completion_tokens < 10
        assert not any(slot.busy for slot in engine.slots)
        assert ask(engine, "Say hi.").result(BOUND_S).reason in ("stop", "length")
        assert engine.kv_problems() == []


class Killed(BaseException):
    """Stands for what no `except Exception` stops (a bug reaching the thread's top)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_finishes_every_request_and_refuses_new_work(smollm2_path, isolated_dirs, monkeypatch):
    engine = engine_for(smollm2_path, isolated_dirs, n_parallel=1, max_queue=8)
    try:
        running = engine.submit(ChatRequest(messages=[{"role": "user", "content": "Count to a thousand."}], sampling=GREEDY,
                                            max_tokens=400, ignore_eos=True))
        queued = ask(engine, "Say hi.")
        next(iter(running))  # the first is decoding

        def die():
            raise Killed("the thread died")

        monkeypatch.setattr(engine.scheduler, "step", die)
        for handle in (running, queued):
            done = handle.result(BOUND_S)
            assert done.reason == "error" and "the thread died" in done.error
        assert engine.stats()["waiting"] == 0
        with pytest.raises(EngineStoppedError, match="restart"):
            ask(engine, "Hello?")
        with pytest.raises(EngineStoppedError):
            engine.release_session("x")
        with pytest.raises(EngineStoppedError):
            engine.seq_positions("x")
    finally:
        engine.close()
    with pytest.raises(EngineStoppedError, match="closed"):
        ask(engine, "Hello?")
