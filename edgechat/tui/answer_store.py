"""The store side of an answer being generated: stored at once, saved as it streams, finished or undone.

The chat screen shows the answer; this keeps the conversation on disk in step with it, so that a
crash or a killed process mid-answer leaves the answer stored and marked "interrupted".
"""

from __future__ import annotations

import time

from edgechat.engine.request import Finished
from edgechat.store import Message, Store

#: seconds between writes of a streaming answer to the store (it is also written when it ends)
SAVE_INTERVAL = 1.0

#: how an answer ended -> its stored status (anything else, an engine or server error, is "error")
_STATUS = {"stop": "complete", "length": "complete", "cancelled": "interrupted"}


class StoredAnswer:
    """One answer in the store, from the moment it is asked for until it ends."""

    def __init__(self, store: Store, conversation_id: str, user_id: int | None, prompt: str, model: str | None):
        self.store = store
        self.conversation_id = conversation_id
        #: the user message sent with it (None for a regenerate): removed again if nothing came back
        self.user_id = user_id
        #: what goes back into the input when the answer is stopped or undone
        self.prompt = prompt
        # Stored at once as "interrupted": a crash mid-answer leaves it marked, and each save updates it.
        self.message = store.add_message(conversation_id, "assistant", "", status="interrupted", meta={"model": model})
        self.id = self.message.id
        #: everything that arrived so far (the store has it as of the last save)
        self.text = ""
        self._saved_at = time.monotonic()

    def append(self, text: str) -> None:
        self.text += text
        now = time.monotonic()
        if now - self._saved_at >= SAVE_INTERVAL:
            self.store.update_message(self.id, content=self.text)
            self._saved_at = now

    def finish(self, finished: Finished) -> Message:
        """The answer ended: store its final text, status and metrics; returns the stored message."""
        m = finished.metrics
        meta = {
            "finish_reason": finished.reason,
            "ttft": round(m.ttft, 4),
            "tok_s": round(m.decode_tps, 2),
            "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens,
            "completion_tokens": m.completion_tokens,
        }
        if finished.error:
            meta["error"] = finished.error
        self.text = finished.text
        status = _STATUS.get(finished.reason, "error")
        self.store.update_message(self.id, content=finished.text, status=status, meta=meta)
        return self.store.get_message(self.id)

    def interrupt(self) -> None:
        """The app is quitting mid-answer: keep what arrived, marked interrupted."""
        self.store.update_message(self.id, content=self.text, status="interrupted")

    def fail(self, error: str) -> None:
        """The stream broke (a bug, not a user error): keep what arrived, marked as an error."""
        self.store.update_message(self.id, content=self.text, status="error", meta={"error": error})

    def undo(self) -> int:
        """Nothing came back: remove the answer and the message sent with it; returns the first id removed."""
        first = self.user_id if self.user_id is not None else self.id
        self.store.delete_messages_from(self.conversation_id, first)
        return first
