"""Commands: work a caller hands the engine thread and waits for (a snapshot, a check, a probe).

Each is a small dataclass that runs against the engine's parts on the engine thread; its caller
gets the result or the error (engine/loop.py answers every command, even from a dying thread).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgechat.engine import probe

if TYPE_CHECKING:
    from edgechat.engine.embeddings import Embedder
    from edgechat.engine.kv.kvcache import KVManager, Slot
    from edgechat.engine.kv.promptcache import PromptCache
    from edgechat.engine.kv.sessions import Conversations
    from edgechat.engine.schedule.draft import DraftModel
    from edgechat.engine.schedule.scheduler import Scheduler


@dataclass(frozen=True)
class Parts:
    """What the engine thread works with, each part built once by the engine and named here."""

    kv: KVManager
    conversations: Conversations
    prompt_cache: PromptCache
    scheduler: Scheduler
    draft: DraftModel | None
    embedder: Embedder | None
    #: the prompt cache writes idle slots' states to disk (`serve --cache-disk`)
    prompt_disk: bool

    @property
    def keeps_idle_prompts(self) -> bool:
        return self.prompt_disk and self.prompt_cache.enabled


@dataclass(eq=False)
class Command:
    """The answer a caller waits for; each kind of command says what it does in `run`."""

    done: threading.Event = field(default_factory=threading.Event, init=False)
    result: Any = field(default=None, init=False)
    error: BaseException | None = field(default=None, init=False)

    def run(self, parts: Parts) -> Any:
        raise NotImplementedError


class Close(Command):
    """The engine is closing: conversations go to their snapshots and idle prompts to disk."""

    def run(self, parts: Parts) -> None:
        for slot in parts.kv.slots:
            parts.kv.save_snapshot(slot)
        if parts.keeps_idle_prompts:
            parts.kv.stash_idle(at_close=True)
        parts.prompt_cache.close()


@dataclass(eq=False)
class Positions(Command):
    """(pos_min, pos_max, mirrored length) of a conversation's sequence; None if it has none."""

    session: str

    def run(self, parts: Parts) -> tuple[int, int, int] | None:
        slot = parts.kv.slot_of(self.session)
        return parts.kv.positions(slot) if slot is not None else None


class Check(Command):
    """Every way the caches' mirrors disagree with the model's cells."""

    def run(self, parts: Parts) -> list[str]:
        problems = parts.kv.check()
        if parts.draft is not None:
            problems += parts.draft.problems()
        if parts.embedder is not None:
            problems += parts.embedder.problems()
        return problems


@dataclass(eq=False)
class Continue(Command):
    """The n tokens greedy decoding appends to a conversation's sequence or to `tokens`."""

    n: int
    session: str | None
    tokens: list[int] | None

    def run(self, parts: Parts) -> list[int]:
        return probe.continuation(parts.scheduler, self.n, self.session, self.tokens)


@dataclass(eq=False)
class TopLogits(Command):
    """The n highest (token, logit) after `tokens`, prefilled cold."""

    tokens: list[int]
    n: int

    def run(self, parts: Parts) -> list[tuple[int, float]]:
        return probe.top_logits(parts.scheduler, self.tokens, self.n)


class ShedCache(Command):
    """The prompt cache lets go of its states in RAM; the bytes let go."""

    def run(self, parts: Parts) -> int:
        return parts.prompt_cache.shed()


@dataclass(eq=False)
class _OnConversation(Command):
    session: str

    def idle_slot(self, parts: Parts) -> Slot | None:
        """The conversation's slot, unless a request runs on it (which ends it the usual way)."""
        slot = parts.kv.slot_of(self.session)
        return slot if slot is not None and not slot.busy else None


class Release(_OnConversation):
    """A conversation went idle: its cells are snapshotted (they stay while room allows)."""

    def run(self, parts: Parts) -> None:
        if (slot := self.idle_slot(parts)) is not None:
            parts.kv.save_snapshot(slot)


class Forget(_OnConversation):
    """A conversation was deleted: its cells, snapshot and state go."""

    def run(self, parts: Parts) -> None:
        if (slot := self.idle_slot(parts)) is not None:
            parts.kv.forget(slot)
        parts.conversations.forget(self.session)
