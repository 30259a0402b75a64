"""The prompt cache: KV states of recent prompts in host RAM, beyond what the slots hold.

Agents and apps re-send the same long contexts (system prompt, tool definitions, the
conversation so far) across more distinct prompts than there are sequences. When an idle slot
is taken over, the KV manager saves what it holds here (`llama_state_seq_get_data`: the
prompt and the answer, whose cells a follow-up request starts with, and the logits after the
prompt); on admission, the entry sharing the longest prefix with the new prompt is restored into
the slot if it beats what the slots hold, and only the rest is prefilled (nothing at all for the
same prompt again: its first token comes from the kept logits).

Entries carry the snapshot store's tags (model hash, context size, KV type, state version):
one whose tags differ from the engine's is never restored. The budget is in bytes; the least
recently used entries leave first.

With a `PromptStore` attached (`serve --cache-disk`), the cache has a second tier on disk that
outlives the process: each entry is written by a thread of its own `WRITE_DELAY_S` after it
comes in (an entry replaced by a longer one meanwhile is never written), so the engine thread
only ever copies a state into RAM, and a crash loses the last seconds at most. An entry that
leaves RAM for the budget stays on disk; a prompt that shares a longer prefix with a file than
with anything in RAM reads that file back (the engine thread, on admission: a few milliseconds
against a prefill). `close` writes whatever is still waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edgechat.engine.kv.prefix import NextLogits, common_prefix
from edgechat.engine.kv.snapshots import PromptState, PromptStore, StoredPrompt, prompt_key

__all__ = ["CachedPrompt", "PromptCache"]

log = logging.getLogger("edgechat.engine")

#: an entry is written this long after it joins the cache: one a longer prompt of the same
#: conversation replaces at once (an agent's next call) is never written at all
WRITE_DELAY_S = 1.0
#: how long closing waits for the writes still due
FLUSH_TIMEOUT_S = 60.0


@dataclass(eq=False)
class CachedPrompt:
    tokens: list[int]
    data: bytearray  # as LlamaBackend.state_seq_get returns it
    tags: dict
    next_logits: NextLogits | None = None  # the slot's, kept with its state
    #: replaced by an entry holding it, or refused by llama.cpp: not worth a file
    gone: bool = False

    @cached_property
    def key(self) -> str:
        return prompt_key(self.tokens, self.tags)

    @property
    def nbytes(self) -> int:
        return len(self.data) + (self.next_logits.values.nbytes if self.next_logits is not None else 0)


class PromptCache:
    """Sequence states by token prefix, LRU within `budget` bytes (0: off)."""

    def __init__(self, budget: int, tags: Callable[[], dict]):
        self.budget = budget
        self._tags = tags  # called on first use: it hashes the model
        self._entries: OrderedDict[int, CachedPrompt] = OrderedDict()  # by id(entry), least recently used first
        self.store: PromptStore | None = None
        #: the store's files for our tags, by key (the writer thread adds, both threads remove)
        self._files: dict[str, StoredPrompt] = {}
        self._files_lock = threading.Lock()
        self._writes: queue.Queue[tuple[float, CachedPrompt, list[str]] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._hurry = threading.Event()  # closing: what is due is written now

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CachedPrompt]:
        return list(self._entries.values())

    def attach(self, store: PromptStore) -> None:
        """Keep entries on disk too, in `store`, and know the files an earlier run left there."""
        self.store = store
        with self._files_lock:
            self._files = {f.key: f for f in store.scan()}
        if self._files:
            log.info("the prompt cache has %d states from an earlier run (%.0f MiB in %s)", len(self._files), self.disk_bytes / 2**20, store.root)

    @property
    def disk_bytes(self) -> int:
        with self._files_lock:
            return sum(f.nbytes for f in self._files.values())

    def longest(self, prompt: list[int], beyond: int = 0) -> tuple[CachedPrompt | None, int]:
        """The entry sharing the longest prefix with the prompt, and that length (None, 0 if none).
        A file sharing more than that and than `beyond` is read back into RAM for it."""
        best, best_n = None, 0
        for entry in self._usable():
            n = common_prefix(entry.tokens, prompt)
            if n > best_n:
                best, best_n = entry, n
        while self.store is not None and (found := self._longest_file(prompt, max(best_n, beyond))) is not None:
            stored, n = found
            if (loaded := self._read_file(stored)) is not None:
                return loaded, n
        return best, best_n

    def _longest_file(self, prompt: list[int], beyond: int) -> tuple[StoredPrompt, int] | None:
        in_ram = {e.key for e in self._entries.values()}
        with self._files_lock:
            # a state larger than the RAM budget (a restart with a smaller --cache-ram) is never read
            files = [f for f in self._files.values() if f.key not in in_ram and f.nbytes <= self.budget]
        best, best_n = None, beyond
        for stored in files:
            n = common_prefix(stored.tokens, prompt)
            if n > best_n:
                best, best_n = stored, n
        return (best, best_n) if best is not None else None

    def _read_file(self, stored: StoredPrompt) -> CachedPrompt | None:
        """A file's state as a RAM entry (not written again); None if it could not be read."""
        assert self.store is not None
        state = self.store.read_state(stored)
        entry = None
        if state is not None:
            logits = None
            if state.logits_n:
                values = np.frombuffer(state.logits, dtype=np.float32)
                values.flags.writeable = False  # shared, as a slot's kept logits are
                logits = NextLogits(state.logits_n, values)
            self.store.touch(stored.key)
            entry = self._add(CachedPrompt(state.tokens, state.data, self._tags(), logits), write=False)
        if entry is None:  # never tried again by this engine (the file stays, if it was whole)
            with self._files_lock:
                self._files.pop(stored.key, None)
        return entry

    def covers(self, tokens: list[int]) -> bool:
        """An entry already holds these tokens (and maybe more after them)."""
        return any(len(e.tokens) >= len(tokens) and e.tokens[: len(tokens)] == tokens for e in self._usable())

    def touch(self, entry: CachedPrompt) -> None:
        self._entries.move_to_end(id(entry))
        if self.store is not None:
            self.store.touch(entry.key)

    def put(self, tokens: list[int], data: bytearray, next_logits: NextLogits | None = None) -> None:
        """Keep a sequence's state; entries it extends (their tokens are a prefix of these) go."""
        self._add(CachedPrompt(list(tokens), data, self._tags(), next_logits), write=True)

    def _add(self, entry: CachedPrompt, write: bool) -> CachedPrompt | None:
        if entry.nbytes > self.budget:
            return None
        replaced = []
        for key, old in list(self._entries.items()):
            if len(old.tokens) <= len(entry.tokens) and entry.tokens[: len(old.tokens)] == old.tokens:
                old.gone = True
                replaced.append(old.key)
                del self._entries[key]
        self._entries[id(entry)] = entry
        total = self.bytes
        while total > self.budget:
            total -= self._entries.pop(next(iter(self._entries))).nbytes
        if write and self.store is not None:
            self._write_later(entry, replaced)
        return entry

    def shed(self) -> int:
        """Let go of every state held in RAM (memory is short); those still waiting for their
        write to disk are written first, by the writer that holds them. The bytes let go."""
        freed = self.bytes
        self._entries.clear()
        return freed

    def drop(self, entry: CachedPrompt) -> None:
        entry.gone = True
        self._entries.pop(id(entry), None)
        if self.store is not None:
            with self._files_lock:
                self._files.pop(entry.key, None)
            self.store.delete(entry.key)

    def close(self) -> None:
        """Write every entry still waiting for its write (closing the engine), then stop writing."""
        if self._writer is None:
            return
        self._hurry.set()
        self._writes.put(None)
        self._writer.join(timeout=FLUSH_TIMEOUT_S)
        if self._writer.is_alive():
            log.warning("the prompt cache's writes did not end within %.0f s", FLUSH_TIMEOUT_S)
        self._writer = None

    def _write_later(self, entry: CachedPrompt, replaced: list[str]) -> None:
        if self._writer is None:
            self._hurry.clear()
            self._writer = threading.Thread(target=self._write_loop, name="edgechat-prompt-writer", daemon=True)
            self._writer.start()
        self._writes.put((time.monotonic() + WRITE_DELAY_S, entry, replaced))

    def _write_loop(self) -> None:
        """The writer thread: each entry once its delay is over (at once when closing)."""
        while (item := self._writes.get()) is not None:
            due, entry, replaced = item
            self._hurry.wait(due - time.monotonic())
            if not entry.gone:
                try:
                    self._write(entry, replaced)
                except Exception as exc:  # a full or read-only disk: the entry stays in RAM alone
                    log.warning("could not write a prompt cache entry to %s: %s", self.store.root if self.store else "", exc)

    def _write(self, entry: CachedPrompt, replaced: list[str]) -> None:
        assert self.store is not None
        key = entry.key
        with self._files_lock:
            known = key in self._files
        if known:
            self.store.touch(key)
        else:
            logits = entry.next_logits
            state = PromptState(entry.tokens, entry.data, logits.n if logits else 0, logits.values.tobytes() if logits else b"")
            removed = self.store.save_state(state)
            with self._files_lock:
                self._files[key] = StoredPrompt(key, entry.tokens, self.store.path_for(key), self.store.path_for(key).stat().st_size)
                for path in removed:
                    self._files.pop(path.stem, None)
        for old in replaced:  # held whole by the file just written
            if old != key:
                with self._files_lock:
                    self._files.pop(old, None)
                self.store.delete(old)

    def _usable(self) -> list[CachedPrompt]:
        """The entries made for this engine's model, context and KV type; any other (a state
        of another model, say) is never restored, so it goes."""
        if not self._entries:
            return []
        tags = self._tags()
        for key, entry in list(self._entries.items()):
            if entry.tags != tags:
                del self._entries[key]
        return list(self._entries.values())
