"""The conversation list: new, search (full text), and picking a conversation."""

from __future__ import annotations

import time

from rich.text import Text
from textual import on
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Button, Input, OptionList
from textual.widgets.option_list import Option

from edgechat.store import Conversation, SearchHit


def day_label(ts: float, now: float | None = None) -> str:
    """The heading a conversation last touched at `ts` is listed under: Today, Yesterday, a weekday
    within the week, else the date."""
    day = time.localtime(ts)
    today = time.localtime(now)
    days = (time.mktime((*today[:3], 0, 0, 0, 0, 0, -1)) - time.mktime((*day[:3], 0, 0, 0, 0, 0, -1))) / 86400
    days = round(days)  # a day across a clock change is 23 or 25 hours
    if days <= 0:
        return "Today"
    if days == 1:
        return "Yesterday"
    if days < 7:
        return time.strftime("%A", day)
    return time.strftime("%-d %b %Y", day)


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
        # One line per title, under a heading for each day (newest first): where one ends and
        # the next begins is plain, and so is how old it is.
        items: list[Option] = []
        heading = None
        for c in conversations:
            label = day_label(c.updated_at)
            if label != heading:
                heading = label
                items.append(Option(Text(label, style="dim italic"), disabled=True))
            items.append(Option(Text(c.title), id=f"c:{c.id}"))
        options = self.options
        options.set_options(items)
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
            label = Text(hit.conversation.title, style="bold")
            label.append("\n")
            # snippet() marks matches with [ ]; show them highlighted instead
            snippet = Text(" ".join(hit.snippet.split()))
            snippet.highlight_regex(r"\[[^\]]*\]", "reverse")
            label.append_text(snippet)
            items.append(Option(label, id=f"m:{hit.conversation.id}:{hit.message.id}"))
        self.options.set_options(items)
        # Enter in the search box opens the highlighted hit: the first until the user moves
        self.options.highlighted = 0

    @on(OptionList.OptionSelected, "#conversations")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self._open(event.option)

    @on(Input.Submitted, "#search")
    def _search_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        options = self.options
        if options.highlighted is not None:
            self._open(options.get_option_at_index(options.highlighted))

    def _open(self, option: Option) -> None:
        kind, _, rest = (option.id or "").partition(":")
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
