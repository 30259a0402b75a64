"""What every part of the chat screen shares: its state, its widgets, the store and the client,
and the helpers more than one part uses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Label
from textual.worker import Worker

from edgechat.errors import StoreError
from edgechat.store import Conversation, Store
from edgechat.store.answer import StoredAnswer
from edgechat.tui.voice import Voice
from edgechat.tui.widgets.attachbar import AttachBar
from edgechat.tui.widgets.chatview import ChatView, MessageBox
from edgechat.tui.widgets.prompt import PromptInput
from edgechat.tui.widgets.sidebar import Sidebar
from edgechat.tui.widgets.statusbar import StatusBar

if TYPE_CHECKING:
    from textual import getters
    from textual.app import App

    from edgechat.attachments import ImageAttachment
    from edgechat.config import Paths
    from edgechat.engine.types.request import ChatRequest
    from edgechat.store import Message as StoredMessage
    from edgechat.tui.client import ChatClient, LocalModels
    from edgechat.tui.config import AppConfig
    from edgechat.tui.mcp import ToolServers

    class ChatApp(App):
        """What the chat screen uses of edgechat's App (tui/app.py's `EdgechatApp`, which composes
        this screen, so it is not imported here)."""

        paths: Paths
        config: AppConfig
        store: Store
        client: ChatClient | None
        model_ref: str | None
        tool_servers: ToolServers
        local_models: LocalModels | None

        def load_model(self, ref: str | None) -> None: ...


class ChatBase(Screen):
    """The screen every part of the chat screen extends: Textual collects `@on` handlers only
    from the classes of a message pump (a part that were a plain mixin would never hear its messages)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv: Conversation | None = None
        #: the answer being generated, wherever the user is looking meanwhile
        self.turn: StoredAnswer | None = None
        #: an answer waiting for the model to finish loading
        self._waiting: tuple[Conversation, StoredAnswer] | None = None
        #: the user message being edited (Enter resends from there)
        self._editing: int | None = None
        #: the last deleted conversation, for undo
        self._deleted: dict | None = None
        self._draft_timer: Timer | None = None
        #: the tools offered to the answer being generated (None: none)
        self._offered = None
        #: answers in a row that called tools since the question
        self._tool_steps = 0
        #: the worker running an answer's calls (asking, running), and whether Esc stopped them
        self._tool_run: Worker | None = None
        self._tools_stopped = False
        #: answers read aloud, questions spoken (tui/voice.py)
        self.voice = Voice(lambda message, severity: self.app.call_from_thread(self.notify, message, severity=severity))

    def notify(self, message: str, **kwargs) -> None:
        # The app's notify: messages here carry titles, model names and errors, never markup.
        self.app.notify(message, **kwargs)

    @property
    def store(self) -> Store:
        return self.app.store

    @property
    def client(self):
        return self.app.client

    @property
    def chat(self) -> ChatView:
        return self.query_one(ChatView)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def attach_bar(self) -> AttachBar:
        return self.query_one(AttachBar)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def sidebar(self) -> Sidebar:
        return self.query_one(Sidebar)

    def refresh_sidebar(self) -> None:
        self.sidebar.show_conversations(self.store.list_conversations(), self.conv.id if self.conv else None)

    def _set_title(self) -> None:
        self.query_one("#conv-title", Label).update(self.conv.title if self.conv else "New chat")

    def _box(self, message_id: int) -> MessageBox | None:
        for box in self.chat.boxes():
            if box.message.id == message_id:
                return box
        return None

    def _update_settings(self, conv: Conversation, **changes) -> Conversation | None:
        try:
            conv = self.store.update_conversation(conv.id, settings={**conv.settings, **changes})
        except StoreError as exc:
            self._store_failed(str(exc))
            return None
        if self.conv is not None and self.conv.id == conv.id:
            self.conv = conv
        return conv

    def _store_failed(self, error: str) -> None:
        """A write to the conversation store failed (a full disk): say so; what is on screen stays."""
        self.notify(f"Not saved: {error}", severity="error", timeout=12)

    def _idle(self) -> bool:
        if self.turn is not None or self._waiting is not None or self._tool_run is not None:
            self.notify("Still answering: wait, or press Esc to stop.", severity="warning")
            return False
        return True

    if TYPE_CHECKING:
        # Textual types `app` as any App; this screen runs in edgechat's (its store, client, config, tools)
        app = getters.app(ChatApp)

        # What the parts call of each other, each defined in the part named.
        async def open_conversation(self, conv_id: str | None) -> None: ...  # the screen
        def _welcome(self, model_ref: str | None) -> Worker[None]: ...  # the screen
        def _save_draft(self) -> None: ...  # the screen
        async def send(self, text: str) -> None: ...  # turn
        async def start_answer(self, user_id: int | None, prompt: str, tool_step: bool = False) -> None: ...  # turn
        def edit_message(self, message: StoredMessage) -> None: ...  # turn
        async def action_regenerate(self, arg: str = "") -> None: ...  # turn
        def _image_refusal(self) -> str | None: ...  # attachments
        def _attachments_fit(self, text: str, content: str, images: list[ImageAttachment]) -> bool: ...  # attachments
        def _restore_attachments(self, turn: StoredAnswer) -> None: ...  # attachments
        def _reattach(self, message: StoredMessage) -> str: ...  # attachments
        def _offer_tools(self, conv: Conversation, request: ChatRequest, box: MessageBox) -> Worker[None]: ...  # tools
        def _run_calls(self, conv_id: str, message_id: int, calls: list[dict]) -> Worker[None]: ...  # tools
        def _measure_context(self, conv: Conversation) -> Worker[None]: ...  # gauge
