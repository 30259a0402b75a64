"""What the engine remembers of each conversation besides its cells: how many of its oldest
messages left the context and the summary written of them. Read on callers' threads (prompt
building), written on the engine thread, saved beside the conversation's KV snapshot."""

from __future__ import annotations

import threading


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
