"""What every part of the chat screen shares: the conversation on screen, the answer being
generated, the widgets, the store and the client, and the helpers more than one part uses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.screen import Screen
from textual.widgets import Label

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

    from edgechat.config import Paths
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
    """The chat screen's shared state and widgets, which its parts (tui/chat/) are given: each
    part keeps its own state and reaches another only through that part's public methods."""

    def __init__(self) -> None:
        super().__init__()
        self.conv: Conversation | None = None
        #: the answer being generated, wherever the user is looking meanwhile
        self.turn: StoredAnswer | None = None
        #: answers read aloud, questions spoken (tui/voice.py)
        self.voice = Voice(lambda message, severity: self.app.call_from_thread(self.notify, message, severity=severity))
        # the widgets the parts reach, which the screen lays out
        self.sidebar = Sidebar(id="sidebar")
        self.chat = ChatView(id="chat")
        self.attach_bar = AttachBar(id="attachments")
        self.prompt = PromptInput(id="prompt", placeholder="Message (Enter sends, Ctrl+J new line, /help)")
        self.status = StatusBar(id="status")

    def notify(self, message: str, **kwargs) -> None:
        # The app's notify: messages here carry titles, model names and errors, never markup.
        self.app.notify(message, **kwargs)

    @property
    def store(self) -> Store:
        return self.app.store

    @property
    def client(self):
        return self.app.client

    def refresh_sidebar(self) -> None:
        self.sidebar.show_conversations(self.store.list_conversations(), self.conv.id if self.conv else None)

    def set_title(self) -> None:
        self.query_one("#conv-title", Label).update(self.conv.title if self.conv else "New chat")

    def box(self, message_id: int) -> MessageBox | None:
        """The box showing a message, if it is on screen."""
        for box in self.chat.boxes():
            if box.message.id == message_id:
                return box
        return None

    def update_settings(self, conv: Conversation, **changes) -> Conversation | None:
        try:
            conv = self.store.update_conversation(conv.id, settings={**conv.settings, **changes})
        except StoreError as exc:
            self.store_failed(str(exc))
            return None
        if self.conv is not None and self.conv.id == conv.id:
            self.conv = conv
        return conv

    def store_failed(self, error: str) -> None:
        """A write to the conversation store failed (a full disk): say so; what is on screen stays."""
        self.notify(f"Not saved: {error}", severity="error", timeout=12)

    if TYPE_CHECKING:
        # Textual types `app` as any App; this screen runs in edgechat's (its store, client, config, tools)
        app = getters.app(ChatApp)
