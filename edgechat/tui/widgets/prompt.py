"""The message input: multi-line, Enter sends, Ctrl+J (or Shift+Enter where the terminal tells) adds a line;
a paste that is a file's path (a file dropped on the terminal) or very long goes to the attachments."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from edgechat.attachments import LONG_PASTE, pasted_path


class PromptInput(TextArea):
    BINDINGS = [
        Binding("ctrl+j,shift+enter", "newline", "New line", show=False),
    ]

    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str):
            super().__init__()
            self.prompt = prompt
            self.text = text

    class Pasted(Message):
        """A paste to attach rather than type: a file's path, or more than LONG_PASTE characters."""

        def __init__(self, prompt: PromptInput, text: str):
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.sent: list[str] = []
        #: position in history while browsing with Up/Down; None when editing a fresh draft
        self._browse: int | None = None
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.remember(text)
                self.post_message(self.Submitted(self, text))
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        # Textual calls TextArea's handler after this one (unless prevented): it inserts any other paste.
        if len(event.text) > LONG_PASTE or pasted_path(event.text) is not None:
            event.stop()
            event.prevent_default()
            self.post_message(self.Pasted(self, event.text))

    def action_newline(self) -> None:
        start, end = self.selection
        self._replace_via_keyboard("\n", start, end)

    def remember(self, text: str) -> None:
        if not self.sent or self.sent[-1] != text:
            self.sent.append(text)
        self._browse = None

    def set_text(self, text: str) -> None:
        """Replace the content and put the cursor at its end."""
        self.load_text(text)
        self.move_cursor(self.document.end)

    def action_cursor_up(self, select: bool = False) -> None:
        # Up on the first line walks back through sent prompts; elsewhere it moves the cursor.
        if select or self.cursor_location[0] > 0 or not self.sent:
            return super().action_cursor_up(select)
        if self._browse is None:
            self._draft = self.text
            self._browse = len(self.sent)
        if self._browse > 0:
            self._browse -= 1
            self.set_text(self.sent[self._browse])

    def action_cursor_down(self, select: bool = False) -> None:
        if select or self._browse is None or self.cursor_location[0] < self.document.line_count - 1:
            return super().action_cursor_down(select)
        self._browse += 1
        if self._browse >= len(self.sent):
            self._browse = None
            self.set_text(self._draft)
        else:
            self.set_text(self.sent[self._browse])
