"""The engine thread: one thread owns the model and runs the scheduling loop over the inbox
(requests, embedding jobs, commands, wake-ups). Nothing a request, a callback or the disk does may
leave a client waiting: every request gets a Finished event, every command an answer within a
bound, and a dead thread refuses new work."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from edgechat.engine.commands import Close, Command, Parts
from edgechat.engine.embeddings import EmbeddingJob
from edgechat.engine.schedule.running import Running
from edgechat.errors import EngineStoppedError

log = logging.getLogger("edgechat.engine")

#: an idle engine writes changed conversations' snapshots after this many seconds
IDLE_SNAPSHOT_S = 30.0
#: after idling, wait this long for requests sent together, so they are prefilled together
BATCH_WINDOW_S = 0.003
#: how long a caller waits for the engine thread to answer a command (a snapshot write included)
COMMAND_TIMEOUT_S = 60.0
#: longest sleep of an engine thread whose requests all wait for image encodes (each encode's end
#: wakes it at once; this bounds a lost wake-up)
ENCODE_POLL_S = 0.5


class EngineLoop:
    """The thread and its inbox. `inbox` is shared with the parts that wake the thread (the
    scheduler puts None there when an image's encode ends)."""

    def __init__(self, parts: Parts, inbox: queue.Queue):
        self.parts = parts
        self._inbox = inbox
        self._lock = threading.Lock()
        self.stopped: str | None = None  # why the thread ended, once it has
        self._thread = threading.Thread(target=self._run, name="edgechat-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def check_running(self) -> None:
        if self.stopped is not None or not self._thread.is_alive():
            raise EngineStoppedError(f"the engine stopped ({self.stopped or 'its thread ended'}); restart edgechat")

    @contextmanager
    def accepting(self) -> Iterator[queue.Queue]:
        """The inbox, under the lock the dying thread takes: nothing is queued into nothing."""
        with self._lock:
            self.check_running()
            yield self._inbox

    def call(self, command: Command, wait: bool = True) -> Any:
        """Run a command on the engine thread; raise rather than wait forever."""
        self.check_running()
        self._inbox.put(command)
        if not wait:
            return None
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not command.done.wait(0.1):
            if not self._thread.is_alive():
                raise EngineStoppedError(f"the engine stopped ({self.stopped or 'its thread ended'}); restart edgechat")
            if time.monotonic() > deadline:
                raise EngineStoppedError(f"the engine did not answer within {COMMAND_TIMEOUT_S:.0f} s; restart edgechat")
        if command.error is not None:
            raise command.error
        return command.result

    def close(self) -> bool:
        """Stop the thread; False when it did not stop (it is inside llama.cpp)."""
        if self._thread.is_alive():
            self._inbox.put(Close())
            self._thread.join(timeout=COMMAND_TIMEOUT_S)
        return not self._thread.is_alive()

    def _run(self) -> None:
        reason = "closed"
        sched, embedder = self.parts.scheduler, self.parts.embedder
        stalled = False  # the last step ran nothing: its requests wait for images' encodes
        try:
            while True:
                block = not sched.active and not sched.waiting and not (embedder is not None and embedder.pending)
                keep_in = self.parts.kv.stash_idle() if self.parts.keeps_idle_prompts else None
                try:
                    if block or stalled:
                        # an encode's end puts a wake-up in the inbox (Scheduler's `wake`)
                        wait = IDLE_SNAPSHOT_S if block else ENCODE_POLL_S
                        item = self._inbox.get(timeout=wait if keep_in is None else min(wait, keep_in))
                    else:
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
                stalled = False
                try:
                    if isinstance(item, Command):
                        if self._command(item):
                            return
                    else:
                        stalled = self._handle(item, block, keep_in)
                except Exception as exc:  # a bug or a llama.cpp failure: fail the running requests, keep serving
                    log.exception("engine step failed")
                    sched.fail_running(exc)
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.exception("the engine thread died")
            raise
        finally:
            self._shut_down(reason)

    def _handle(self, item: object, block: bool, keep_in: float | None) -> bool:
        """One turn of the loop for what came in (None: nothing); True when the step ran nothing
        because its requests wait for images' encodes."""
        sched, embedder = self.parts.scheduler, self.parts.embedder
        if isinstance(item, Running):
            sched.waiting.append(item)
            if block and sched.n_parallel > 1:
                time.sleep(BATCH_WINDOW_S)
        elif isinstance(item, EmbeddingJob):
            assert embedder is not None  # embed() refuses work without one
            embedder.add(item)
        elif block and keep_in is None:  # idle for a while: put the conversations that changed on disk
            for slot in self.parts.kv.slots:
                self.parts.kv.save_snapshot(slot)
        else:
            sched.admit()
            stalled = bool(sched.active) and not sched.step() and sched.encoding
            # one embedding chunk per chat step: a long batch holds the streams up for a chunk's
            # decode at a time, never for the whole batch
            if embedder is not None and embedder.pending:
                embedder.step()
            return stalled
        return False

    def _command(self, command: Command) -> bool:
        """Run one command; True when the engine is to stop. Its caller always gets an answer."""
        try:
            command.result = command.run(self.parts)
            return isinstance(command, Close)
        except Exception as exc:
            log.exception("engine command %s failed", type(command).__name__)
            command.error = exc
            return False
        finally:
            command.done.set()

    def _shut_down(self, reason: str) -> None:
        """The thread is ending: whatever was asked of it gets an answer, and nothing more comes in."""
        with self._lock:
            self.stopped = reason
        gone = EngineStoppedError(f"the engine stopped ({reason}); restart edgechat")
        unqueued = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Running):
                unqueued.append(item)
            elif isinstance(item, EmbeddingJob) and self.parts.embedder is not None:
                self.parts.embedder.end(item, gone)
            elif isinstance(item, Command):
                item.error = gone
                item.done.set()
        self.parts.scheduler.end_all(unqueued, None if reason == "closed" else f"the engine stopped ({reason})")
        if self.parts.embedder is not None:
            self.parts.embedder.fail_all(gone)
