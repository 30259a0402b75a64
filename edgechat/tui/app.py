"""The edgechat chat app: opens instantly, loads the model in the background, stores everything."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.worker import Worker, WorkerState

from edgechat.config import Paths
from edgechat.errors import EdgechatError
from edgechat.models import DEFAULT_MODEL
from edgechat.store import Store, open_store
from edgechat.tui.actions import ACTIONS
from edgechat.tui.client import ChatClient
from edgechat.tui.commands import ChatCommands
from edgechat.tui.config import load_config, save_tui_setting
from edgechat.tui.mcp import ToolServers
from edgechat.tui.screens.chat import ChatScreen

if TYPE_CHECKING:
    from edgechat.tui.client import LocalModels

ClientFactory = Callable[[str | None], ChatClient]


class EdgechatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "edgechat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    # Textual's own Ctrl+Q, shown in the footer of main keys like the chat screen's others
    BINDINGS = [Binding(a.key, a.name, a.hint, priority=True) for a in ACTIONS if a.name == "quit" and a.key]

    def __init__(
        self,
        paths: Paths,
        model: str | None = None,
        url: str | None = None,
        api_key: str | None = None,
        client_factory: ClientFactory | None = None,
        store: Store | None = None,
        engine_options: dict | None = None,
    ):
        super().__init__()
        self.paths = paths
        self.config = load_config(paths)
        self.store = store or open_store(paths)
        #: the MCP servers of config.toml, each started when a conversation first uses it
        self.tool_servers = ToolServers(self.config.mcp_servers)
        self.url = url
        self.model_ref = model or self.config.model or (None if url else DEFAULT_MODEL)
        self.client: ChatClient | None = None
        #: EngineConfig fields from the command line for local models (--gpu-layers, --rpc, --draft-model, --mmproj)
        self.engine_options = engine_options or {}
        #: the local models this app loaded and keeps while memory allows (None: remote, or a caller's factory)
        self.local_models: LocalModels | None = None
        self._client_factory = client_factory or self._default_factory(url, api_key)
        #: clients from a caller's factory belong to the caller (tests share one engine between apps)
        self._owns_clients = client_factory is None
        self._closed = False
        #: the load asked for last (and its model); an earlier one still running is not wanted any more
        self._wanted: Worker | None = None
        self._wanted_ref: str | None = None
        #: clients loaded but not yet taken by the UI thread: whoever takes one (the UI, or
        #: shutdown) removes it under the lock, so a model loading while the app quits is closed
        self._loaded: list[ChatClient] = []
        self._loaded_lock = threading.Lock()

    def _default_factory(self, url: str | None, api_key: str | None) -> ClientFactory:
        def make(ref: str | None) -> ChatClient:
            if url:
                from edgechat.tui.client import RemoteClient

                return RemoteClient(url, api_key, ref)
            from edgechat.tui.client import LocalClient

            with self._loaded_lock:
                if self._closed:  # a pool made now would have nobody to close it
                    raise EdgechatError("the app is closing")
                if self.local_models is None:
                    from edgechat.tui.client import LocalModels

                    self.local_models = LocalModels(self.paths, idle_unload=self.config.idle_unload)
            options = dict(self.engine_options)
            if ref != self.model_ref:
                # --draft-model drafts for (and --mmproj reads images for) the model it was given
                # with; others use their catalog's
                options.pop("draft_model", None)
                options.pop("mmproj", None)
            return LocalClient(ref, self.paths, on_progress=self._load_progress(ref), engine_options=options,
                               models=self.local_models)

        return make

    @property
    def chat_screen(self) -> ChatScreen:
        return next(s for s in self.screen_stack if isinstance(s, ChatScreen))

    def on_mount(self) -> None:
        if self.config.theme and self.config.theme in self.available_themes:
            self.theme = self.config.theme
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        # The model starts loading before the first frame; the screen shows it as loading.
        self._load(self.model_ref)
        self.push_screen(ChatScreen())

    def _remember_theme(self, theme) -> None:
        if theme.name != self.config.theme:
            self.config.theme = theme.name
            try:
                save_tui_setting(self.paths, "theme", theme.name)
            except (OSError, EdgechatError) as exc:
                self.notify(f"Cannot save the theme: {exc}", severity="warning")

    def notify(self, message: str, *, markup: bool = False, **kwargs) -> None:
        # Notifications carry user text (titles, model names, paths, errors): shown as written.
        super().notify(message, markup=markup, **kwargs)

    # -- the model -------------------------------------------------------

    def load_model(self, ref: str | None) -> None:
        """Load `ref` in a thread; the UI stays usable and the old model serves until the new one is up."""
        screen = self.chat_screen
        screen.status.state = f"loading {ref or 'model'}…"
        if self.client is None:
            screen.status.model = ref or "model"
        self._load(ref)

    def _load_progress(self, ref: str | None) -> Callable[[float], None]:
        """For the loading thread: shows the share of the model read, in 10% steps (a big model on
        a phone takes a while; llama.cpp reports every tensor, far too often to redraw for each)."""
        last = -1

        def report(fraction: float) -> None:
            nonlocal last
            step = int(fraction * 10)
            if step != last and self._wanted_ref == ref:  # not a load given up for a newer one
                last = step
                with contextlib.suppress(RuntimeError):  # the app is closing: nobody to tell
                    self.call_from_thread(self._show_load_progress, f"loading {ref or 'model'}… {step * 10}%")

        return report

    def _show_load_progress(self, text: str) -> None:
        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen) and screen.status.state.startswith("loading"):
                screen.status.state = text

    def _load(self, ref: str | None) -> None:
        self._wanted_ref = ref
        self._wanted = self._load_worker(ref)

    # Not exclusive: cancelling a thread worker does not stop its thread, and the model it then
    # loaded would be dropped without being closed. Every load ends here; the unwanted are closed.
    @work(thread=True, group="load-model", exit_on_error=False)
    def _load_worker(self, ref: str | None) -> ChatClient:
        client = self._client_factory(ref)
        with self._loaded_lock:
            if not self._closed:
                self._loaded.append(client)
                return client
        if self._owns_clients:  # the app quit while it loaded
            client.close()
        return client

    def _take(self, client: ChatClient) -> bool:
        with self._loaded_lock:
            if client not in self._loaded:
                return False  # shutdown closed it
            self._loaded.remove(client)
            return True

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group != "load-model":
            return
        screen = self.chat_screen
        loaded: ChatClient | None = event.worker.result if event.state == WorkerState.SUCCESS else None
        if event.worker is not self._wanted:
            # a model asked for before the last switch: close it, and say nothing of its failure
            if loaded is not None and self._take(loaded) and self._owns_clients:
                self._close_client(loaded)
            return
        if loaded is not None:
            if not self._take(loaded):
                return
            old, self.client = self.client, loaded
            self.model_ref = loaded.model_name
            if old is not None and self._owns_clients:
                self._close_client(old)
            screen.model_ready()
        elif event.state == WorkerState.ERROR:
            error = event.worker.error
            message = str(error) if isinstance(error, EdgechatError) else f"{type(error).__name__}: {error}"
            self.call_later(screen.model_failed, f"Cannot load the model: {message}")

    @work(thread=True, group="close-model", exit_on_error=False)
    def _close_client(self, client: ChatClient) -> None:
        client.close()

    # -- quitting --------------------------------------------------------

    async def action_quit(self) -> None:
        self.shutdown()
        self.exit()

    def shutdown(self) -> None:
        """Store what is in flight, release the conversation's KV, free the model. Idempotent."""
        with self._loaded_lock:
            if self._closed:
                return
            self._closed = True
            unclaimed, self._loaded = self._loaded, []
        try:
            screen = self.chat_screen
        except StopIteration:
            screen = None
        if screen is not None:
            screen.shutdown()
        client, self.client = self.client, None
        if client is not None:
            if screen is not None and screen.conv is not None:
                try:
                    client.release_session(screen.conv.id)
                except EdgechatError:
                    pass
            if self._owns_clients:
                client.close()
        if self._owns_clients:
            for loaded in unclaimed:
                loaded.close()
            if self.local_models is not None:
                self.local_models.close()  # the models kept loaded, each snapshotting its conversations
        self.tool_servers.close()

    def on_unmount(self) -> None:
        self.shutdown()
