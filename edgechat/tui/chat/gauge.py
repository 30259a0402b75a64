"""The context gauge: how much of the model's context a conversation fills, in the status bar."""

from __future__ import annotations

from functools import partial

from textual.worker import Worker

from edgechat.engine.types.request import RequestMetrics
from edgechat.params import ContextPolicy
from edgechat.store import Conversation
from edgechat.store.history import model_messages
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.config import build_request


class GaugePart:
    def __init__(self, screen: ChatBase) -> None:
        self.screen = screen

    def measure(self, conv: Conversation) -> Worker[None]:
        """Fill the context gauge for a conversation just opened (its whole history, template
        applied), off the UI thread."""
        return self.screen.run_worker(partial(self._measure, conv), group="measure", thread=True, exclusive=True,
                                      exit_on_error=False)

    def _measure(self, conv: Conversation) -> None:
        count = getattr(self.screen.client, "count_tokens", None)
        if count is None:  # a client that cannot count (remote): the whole history is not worth reading
            return
        history = model_messages(self.screen.store, conv.id)
        if not history:
            return
        used = count(build_request({**conv.settings, "context_policy": ContextPolicy.SHIFT.value}, history, session=None))
        self.screen.app.call_from_thread(self._show_context, conv.id, used)

    def _show_context(self, conv_id: str, used: int) -> None:
        screen = self.screen
        if screen.conv is not None and screen.conv.id == conv_id and screen.turn is None:
            screen.status.context_used = used

    def show(self, m: RequestMetrics) -> None:
        """An answer's metrics: the context it filled, its speed."""
        status = self.screen.status
        status.context_used = m.context_tokens
        status.context_size = m.context_size or status.context_size
        status.ttft = m.ttft
        status.tok_s = m.decode_tps
        status.spec = 100 * m.accepted_tokens / m.drafted_tokens if m.drafted_tokens else None
