"""The store side of an answer being generated: stored at once, saved as it streams, finished or undone.

Every front end that stores answers (the chat app, `edgechat run --session`) goes through this,
so a crash or a killed process mid-answer leaves the answer stored and marked "interrupted",
with what had streamed by its last save. A write that fails (a full disk) never loses the text:
it stays here, the front end is told once through `on_error`, and the next save tries again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from edgechat.errors import StoreError
from edgechat.store.db import ImageLike, Message, Store

if TYPE_CHECKING:
    from edgechat.engine.types.request import Finished

#: seconds between writes of a streaming answer to the store (its first text and its end are written at once)
SAVE_INTERVAL = 1.0

#: how an answer ended -> its stored status (anything else, an engine or server error, is "error")
_STATUS = {"stop": "complete", "length": "complete", "cancelled": "interrupted"}


class StoredAnswer:
    """One answer in the store, from the moment it is asked for until it ends."""

    def __init__(
        self,
        store: Store,
        conversation_id: str,
        user_id: int | None,
        prompt: str,
        model: str | None,
        *,
        message: Message | None = None,
        on_error: Callable[[str], None] | None = None,
    ):
        self.store = store
        self.conversation_id = conversation_id
        #: the user message sent with it (None for a regenerate): removed again if nothing came back
        self.user_id = user_id
        #: what goes back into the input when the answer is stopped or undone
        self.prompt = prompt
        self.on_error = on_error
        #: the last write that failed, None once a later write succeeds
        self.error: StoreError | None = None
        # Stored at once as "interrupted": a crash mid-answer leaves it marked, and each save updates it.
        self.message = message or store.add_message(conversation_id, "assistant", "", status="interrupted", meta={"model": model})
        self.id = self.message.id
        #: everything that arrived so far (the store has it as of the last save)
        self.text = ""
        #: a reasoning model's thoughts so far, kept apart from the answer
        self.reasoning = ""
        #: seconds from the first thought to the first word of the answer (None: no thoughts yet)
        self.thought_s: float | None = None
        self._saved_at: float | None = None

    @classmethod
    def ask(cls, store: Store, conversation_id: str, question: str, model: str | None,
            images: Sequence[ImageLike] = (), **kwargs) -> StoredAnswer:
        """Store a question (with the pictures sent with it) and its answer-to-be in one write
        (both or neither)."""
        user, answer = store.add_turn(conversation_id, question, meta={"model": model}, images=images)
        return cls(store, conversation_id, user.id, question, model, message=answer, **kwargs)

    def append(self, text: str, reasoning: bool = False) -> None:
        """More of the answer, or (`reasoning`) more of the model's thoughts before it."""
        if reasoning:
            self.reasoning += text
        else:
            self.text += text
        now = time.monotonic()
        # The first text at once: a turn killed right after it started to answer keeps it.
        if self._saved_at is None or now - self._saved_at >= SAVE_INTERVAL:
            self._saved_at = now
            self._write(**self._texts())

    def _texts(self) -> dict:
        # thoughts are written only by an answer that has them: other answers' writes stay as before
        return {"content": self.text, **({"reasoning": self.reasoning} if self.reasoning else {})}

    def finish(self, finished: Finished) -> Message:
        """The answer ended: store its final text, status and metrics; returns the message (as
        stored, or as it would have been when the write failed or the message is gone)."""
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
        # the engine's thoughts are whole (a remote server's may be only what streamed)
        self.reasoning = finished.reasoning or self.reasoning
        if self.reasoning:
            meta["reasoning_tokens"] = m.reasoning_tokens
            if self.thought_s is not None:
                meta["thought_s"] = round(self.thought_s, 2)
        status = _STATUS.get(finished.reason, "error")
        if self._write(**self._texts(), status=status, meta=meta) and (stored := self.store.get_message(self.id)):
            return stored
        return Message(self.id, self.conversation_id, "assistant", finished.text, status,
                       {**self.message.meta, **meta}, self.message.created_at, self.reasoning)

    def interrupt(self) -> None:
        """The app is quitting mid-answer: keep what arrived, marked interrupted."""
        self._write(**self._texts(), status="interrupted")

    def fail(self, error: str) -> None:
        """The stream broke (a bug, not a user error): keep what arrived, marked as an error."""
        self._write(**self._texts(), status="error", meta={"error": error})

    def undo(self) -> int:
        """Nothing came back: remove the answer and the message sent with it; returns the first id removed.
        Should the removal fail, the empty answer left marks its question as unanswered."""
        first = self.user_id if self.user_id is not None else self.id
        try:
            self.store.delete_messages_from(self.conversation_id, first)
        except StoreError as exc:
            self._failed(exc)
        return first

    def _write(self, **changes) -> bool:
        try:
            self.store.update_message(self.id, **changes)
        except StoreError as exc:
            self._failed(exc)
            return False
        self.error = None
        return True

    def _failed(self, exc: StoreError) -> None:
        if self.error is None and self.on_error is not None:
            self.on_error(str(exc))
        self.error = exc
