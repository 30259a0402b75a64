"""The context gauge: how much of the model's context a conversation fills, in the status bar."""

from __future__ import annotations

from textual import on, work

from edgechat.params import ContextPolicy
from edgechat.store import Conversation
from edgechat.store.history import model_messages
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.config import build_request
from edgechat.tui.widgets.chatview import ChatView


class GaugePart(ChatBase):
    @work(thread=True, exclusive=True, group="measure", exit_on_error=False)
    def _measure_context(self, conv: Conversation) -> None:
        """Fill the context gauge for a conversation just opened (its whole history, template applied)."""
        count = getattr(self.client, "count_tokens", None)
        if count is None:  # a client that cannot count (remote): the whole history is not worth reading
            return
        history = model_messages(self.store, conv.id)
        if not history:
            return
        used = count(build_request({**conv.settings, "context_policy": ContextPolicy.SHIFT.value}, history, session=None))
        self.app.call_from_thread(self._show_context, conv.id, used)

    def _show_context(self, conv_id: str, used: int) -> None:
        if self.conv is not None and self.conv.id == conv_id and self.turn is None:
            self.status.context_used = used

    @on(ChatView.AnswerMetrics)
    def _metrics(self, event: ChatView.AnswerMetrics) -> None:
        m = event.metrics
        self.status.context_used = m.context_tokens
        self.status.context_size = m.context_size or self.status.context_size
        self.status.ttft = m.ttft
        self.status.tok_s = m.decode_tps
        self.status.spec = 100 * m.accepted_tokens / m.drafted_tokens if m.drafted_tokens else None
