"""What the engine remembers of each conversation besides its cells: how many of its oldest
messages left the context and the summary written of them. Read on callers' threads (prompt
building), written on the engine thread, saved beside the conversation's KV snapshot."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from edgechat.engine.kv.snapshots import SnapshotStore


class ConversationStates:
    def __init__(self) -> None:
        self._states: dict[str, dict] = {}  # session -> {"evicted": int, "summary": str}
        self._lock = threading.Lock()

    def get(self, session: str) -> dict | None:
        """A copy of the conversation's state, or None when this run has none."""
        with self._lock:
            state = self._states.get(session)
            return dict(state) if state is not None else None

    def update(self, session: str, **values) -> None:
        with self._lock:
            self._states.setdefault(session, {}).update(values)

    def add_evicted(self, session: str, n: int) -> None:
        with self._lock:
            state = self._states.setdefault(session, {})
            state["evicted"] = state.get("evicted", 0) + n

    def forget(self, session: str) -> None:
        with self._lock:
            self._states.pop(session, None)


@dataclass(frozen=True)
class Conversations:
    """Where conversations outlive their cells: this run's states and the snapshots on disk,
    shared by the KV manager (which saves and restores both) and prompt building (which reads)."""

    states: ConversationStates
    snapshots: SnapshotStore

    def state(self, session: str) -> dict:
        """The conversation's eviction state: this run's, else the one its snapshot carries from
        an earlier run, else none."""
        state = self.states.get(session)
        if state is not None:
            return state
        return self.snapshots.peek_state(session) or {}

    def forget(self, session: str) -> None:
        """The conversation was deleted: its snapshot and state go."""
        self.snapshots.delete(session)
        self.states.forget(session)
