"""The main screen: sidebar, conversation, input and status bar, and the parts in
`edgechat/tui/chat/` it holds (a chat turn, attachments, tools, the context gauge, the slash
commands), each an object with its own state; the screen lays out the widgets, keeps the draft,
opens conversations, and hands each key, command and message to the part that owns it."""

from __future__ import annotations

from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.timer import Timer
from textual.widgets import Button, Footer, Label, TextArea
from textual.worker import Worker, get_current_worker

from edgechat.store import atomic_write_text
from edgechat.tui.actions import ACTIONS
from edgechat.tui.chat.attachments import AttachmentsPart
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.chat.commands import CommandsPart
from edgechat.tui.chat.gauge import GaugePart
from edgechat.tui.chat.tools import ToolsPart
from edgechat.tui.chat.turn import TurnPart
from edgechat.tui.welcome import welcome_markdown
from edgechat.tui.widgets.chatview import PAGE, ChatView, MessageBox
from edgechat.tui.widgets.prompt import PromptInput
from edgechat.tui.widgets.sidebar import Sidebar

#: below this width the sidebar becomes a toggle (phones in portrait, split panes)
NARROW = 70


#: the part that runs each action of tui/actions.py's table (keys, slash commands, the palette),
#: by its method of the action's name
RUNS = {
    "turn_part": ("stop", "regenerate", "edit_last"),
    "attachments": ("attach", "image", "detach"),
    "tools": ("tools",),
    "commands": ("new", "branch", "rename", "delete", "undo", "search", "settings", "preset", "system", "model",
                 "export", "clear", "copy", "copy_code", "toggle_sidebar", "toggle_stats", "toggle_thoughts", "theme",
                 "speak", "talk", "help", "quit"),
}


class PartAction:
    """The chat screen's `action_<name>`, where Textual looks for it: the method of that name of
    the part that runs it."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, screen: ChatScreen | None, owner: type | None = None):
        return self if screen is None else getattr(getattr(screen, self.part), self.name)


class ChatScreen(ChatBase):
    # (quit is the app's own binding)
    BINDINGS = [
        Binding(a.key, a.name, a.hint or a.title, show=bool(a.hint)) for a in ACTIONS if a.key and a.name != "quit"
    ]

    def __init__(self) -> None:
        super().__init__()
        self._draft_timer: Timer | None = None
        self.gauge = GaugePart(self)
        self.attachments = AttachmentsPart(self)
        self.tools = ToolsPart(self)
        self.turn_part = TurnPart(self, self.attachments, self.tools, self.gauge, self.open_conversation)
        self.commands = CommandsPart(self, self.turn_part, self.open_conversation)

    def compose(self):
        with Horizontal(id="body"):
            yield self.sidebar
            with Vertical(id="main"):
                with Horizontal(id="topbar"):
                    yield Button("☰", id="toggle-sidebar", compact=True)
                    yield Label("New chat", id="conv-title", markup=False)
                yield self.chat
                yield self.attach_bar
                yield self.prompt
        yield self.status
        yield Footer()

    def on_mount(self) -> None:
        self.set_class(self.app.size.width < NARROW, "-narrow")
        self.voice.reading = self.app.config.speak
        if self.client is None:
            self.status.model = self.app.model_ref or "model"
            self.status.state = "loading…"
        self.refresh_sidebar()
        self._welcome(self.app.model_ref)
        draft = self._draft_file()
        if draft.is_file():
            self.prompt.set_text(draft.read_text(encoding="utf-8"))
        self.prompt.focus()

    @work(thread=True, exclusive=True, group="welcome", exit_on_error=False)
    def _welcome(self, model_ref: str | None) -> None:
        # Reads free memory and the Hub cache: not on the UI thread, which draws the first frame.
        text = welcome_markdown(model_ref, self.app.paths)
        if not get_current_worker().is_cancelled:  # a model loaded since: its own call says what to show
            self.app.call_from_thread(self.chat.set_welcome, text)  # type: ignore[arg-type]  # Textual's `T | Awaitable[T]` callback: mypy solves no T for a coroutine

    def _draft_file(self):
        return self.app.paths.data / "draft.txt"

    def _place_toasts(self) -> None:
        # Notifications stack up from just above the input (Textual puts them over the bottom
        # rows, where the input is: the text being edited was hidden). The input grows with its
        # text and the footer comes and goes with the width, so the gap is measured, not styled.
        above = self.prompt.region if self.prompt.region else self.status.region
        gap = self.size.height - above.y
        for rack in self.query("#textual-toastrack"):  # (none where notifications are off)
            if rack.styles.margin.bottom != gap:
                rack.styles.margin = (0, 0, gap, 0)

    @on(TextArea.Changed, "#prompt")
    def _prompt_changed(self) -> None:
        self.call_after_refresh(self._place_toasts)
        # Typed text survives a quit or a killed process: saved half a second after the last key.
        if self._draft_timer is not None:
            self._draft_timer.stop()
        self._draft_timer = self.set_timer(0.5, self._save_draft)

    def _save_draft(self) -> None:
        self._draft_timer = None
        text = self.prompt.text
        try:
            if text.strip():
                atomic_write_text(self._draft_file(), text)
            else:
                self._draft_file().unlink(missing_ok=True)
        except OSError as exc:
            self.notify(f"Cannot save the draft: {exc.strerror}", severity="warning")

    def on_resize(self, event) -> None:
        self.set_class(event.size.width < NARROW, "-narrow")
        self.call_after_refresh(self._place_toasts)

    async def open_conversation(self, conv_id: str | None) -> None:
        """Show a conversation (None: a fresh draft, stored once its first message is sent)."""
        previous = self.conv
        self.turn_part.editing = None
        if conv_id is None:
            self.conv = None
            await self.chat.show([], 0)
        else:
            conv = self.store.get_conversation(conv_id)
            if conv is None:
                return
            self.conv = conv
            total = self.store.count_messages(conv.id)
            messages = self.turn_part.with_live_text(self.store.messages(conv.id, limit=PAGE))
            await self.chat.show(messages, total, self.turn.id if self.turn else None)
        self.set_title()
        self.refresh_sidebar()
        self.status.context_used = 0
        if self.conv is not None and self.client is not None:
            self.gauge.measure(self.conv)
        if previous is not None and (self.conv is None or previous.id != self.conv.id):
            self._release(previous.id)
        if self.has_class("-narrow"):
            self.remove_class("-sidebar-open")
        self.prompt.focus()

    @work(thread=True, group="release", exit_on_error=False)
    def _release(self, conv_id: str) -> None:
        client = self.client
        if client is not None and (self.turn is None or self.turn.conversation_id != conv_id):
            client.release_session(conv_id)

    @on(ChatView.LoadEarlier)
    async def _load_earlier(self) -> None:
        boxes = self.chat.boxes()
        if self.conv is None or not boxes:
            return
        first = boxes[0].message.id
        older = self.store.messages(self.conv.id, limit=PAGE, before=first)
        remaining = self.store.count_messages(self.conv.id, before=older[0].id) if older else 0
        await self.chat.prepend(older, remaining)

    @on(Sidebar.Picked)
    async def _picked(self, event: Sidebar.Picked) -> None:
        await self.open_conversation(event.conversation_id)
        if event.message_id is not None:
            for box in self.chat.boxes():
                if box.message.id == event.message_id:
                    self.chat.scroll_to_widget(box, animate=False, top=True)
                    box.focus()
                    break

    @on(Sidebar.NewRequested)
    async def _new_requested(self) -> None:
        await self.open_conversation(None)

    @on(Sidebar.SearchChanged)
    def _search_changed(self, event: Sidebar.SearchChanged) -> None:
        if event.query.strip():
            self.sidebar.show_hits(self.store.search(event.query))
        else:
            self.refresh_sidebar()

    # -- the app's calls --------------------------------------------------

    def model_ready(self) -> None:
        """The app loaded a model: show it, and answer a message that was waiting for it."""
        client = self.client
        self.status.model = client.model_name
        self.status.backend = client.backend
        self.status.model_memory = getattr(client, "memory", 0)
        self.status.context_size = client.n_ctx or 0
        self.attach_bar.context_size = client.n_ctx or 0
        self.attach_bar.refresh_summary()
        self.status.state = "ready"
        self._welcome(client.model_name)
        if self.conv is not None:
            self.gauge.measure(self.conv)
        if client.template_warning:
            self.notify(f"{client.model_name}: {client.template_warning}", severity="warning", timeout=8)
        self.turn_part.answer_waiting()

    async def model_failed(self, error: str) -> None:
        self.status.state = "ready" if self.client else "no model"
        self.notify(error, severity="error", timeout=12)
        await self.turn_part.give_back_waiting()

    def shutdown(self) -> None:
        """Quitting: keep the draft, stop the answer and store what arrived, marked interrupted."""
        self._save_draft()
        self.turn_part.shutdown()

    # -- messages, each to the part that owns it ---------------------------

    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        await self.turn_part.send(event.text)

    @on(PromptInput.Pasted)
    def _pasted(self, event: PromptInput.Pasted) -> None:
        self.attachments.pasted(event.text)

    @on(ChatView.AnswerDelta)
    @on(ChatView.AnswerThoughtsEnded)
    @on(ChatView.AnswerEvicted)
    @on(ChatView.AnswerFinished)
    @on(ChatView.AnswerFailed)
    async def _answer_event(self, event: Message) -> None:
        await self.turn_part.answer_event(event)

    @on(ChatView.AnswerMetrics)
    def _metrics(self, event: ChatView.AnswerMetrics) -> None:
        self.gauge.show(event.metrics)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        self.turn_part.worker_changed(event)

    @on(Button.Pressed, "#toggle-sidebar")
    @on(Button.Pressed, "#close-sidebar")
    def _toggle_pressed(self) -> None:
        self.commands.toggle_sidebar()

    @on(MessageBox.Action)
    async def _message_action(self, event: MessageBox.Action) -> None:
        await self.commands.message_action(event)


for _part, _names in RUNS.items():
    for _name in _names:
        setattr(ChatScreen, f"action_{_name}", PartAction(_part, _name))
