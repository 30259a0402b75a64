"""The conversation list: new, search (full text), and picking a conversation."""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Button, Input, OptionList
from textual.widgets.option_list import Option

from edgechat.store import Conversation, SearchHit


class Sidebar(Vertical):
    class Picked(Message):
        def __init__(self, conversation_id: str, message_id: int | None = None):
            super().__init__()
            self.conversation_id = conversation_id
            #: set when picked from a search hit: the message to bring into view
            self.message_id = message_id

    class NewRequested(Message):
        pass

    class SearchChanged(Message):
        def __init__(self, query: str):
            super().__init__()
            self.query = query

    def compose(self):
        # Only shown on narrow screens, where the open sidebar covers the chat.
        yield Button("◀ Back to the chat", id="close-sidebar", compact=True)
        yield Input(placeholder="Search…", id="search", compact=True)
        yield Button("+ New chat", id="new-chat", variant="primary", compact=True)
        yield OptionList(id="conversations")

    @property
    def options(self) -> OptionList:
        return self.query_one("#conversations", OptionList)

    def show_conversations(self, conversations: list[Conversation], current: str | None) -> None:
        options = self.options
        options.set_options(
            Option(Text(c.title, no_wrap=True, overflow="ellipsis"), id=f"c:{c.id}") for c in conversations
        )
        if current is not None:
            try:
                options.highlighted = options.get_option_index(f"c:{current}")
            except Exception:  # noqa: BLE001 - OptionDoesNotExist: the current one is not listed
                pass

    def show_hits(self, hits: list[SearchHit]) -> None:
        if not hits:
            self.options.set_options([Option(Text("no matches", style="italic"), disabled=True)])
            return
        items = []
        for hit in hits:
            label = Text(hit.conversation.title, style="bold", no_wrap=True, overflow="ellipsis")
            label.append("\n")
            # snippet() marks matches with [ ]; show them highlighted instead
            snippet = Text(" ".join(hit.snippet.split()), no_wrap=True, overflow="ellipsis")
            snippet.highlight_regex(r"\[[^\]]*\]", "reverse")
            label.append_text(snippet)
            items.append(Option(label, id=f"m:{hit.conversation.id}:{hit.message.id}"))
        self.options.set_options(items)

    @on(OptionList.OptionSelected, "#conversations")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        kind, _, rest = (event.option.id or "").partition(":")
        if kind == "c":
            self.post_message(self.Picked(rest))
        elif kind == "m":
            conv_id, _, msg_id = rest.partition(":")
            self.post_message(self.Picked(conv_id, int(msg_id)))

    @on(Button.Pressed, "#new-chat")
    def _new(self, event: Button.Pressed) -> None:
        event.stop()
        self.post_message(self.NewRequested())

    @on(Input.Changed, "#search")
    def _search(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(self.SearchChanged(event.value))

    def search(self, query: str) -> None:
        box = self.query_one("#search", Input)
        box.value = query
        box.focus()
