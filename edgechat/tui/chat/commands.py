"""The slash commands and keys that belong to no other part: conversations (new, branch, rename,
delete, undo, clear, search), settings, system prompt and presets, the model, export, copying,
the sidebar, stats, thoughts and theme, help and quit; and a message's own buttons."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

from edgechat.errors import EdgechatError, UsageError
from edgechat.store import atomic_write_text, export_conversation
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.chat.turn import TurnPart
from edgechat.tui.config import save_tui_setting, validate_settings
from edgechat.tui.presets import find_preset, load_presets
from edgechat.tui.screens.dialogs import ConfirmScreen, TextPromptScreen
from edgechat.tui.screens.help import HelpScreen
from edgechat.tui.screens.models import ModelPickerScreen
from edgechat.tui.screens.pickers import PresetPickerScreen
from edgechat.tui.screens.settings import SettingsScreen
from edgechat.tui.widgets.chatview import MessageBox

_CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)


class CommandsPart:
    def __init__(self, screen: ChatBase, turn_part: TurnPart, open_conversation: Callable[[str | None], Awaitable[None]]) -> None:
        self.screen = screen
        self.turn_part = turn_part
        #: the screen's own: shows a conversation (None: a fresh draft)
        self._open_conversation = open_conversation
        #: the last deleted conversation, for undo
        self._deleted: dict | None = None

    def _forget(self, conv_id: str) -> None:
        if self.screen.client is not None:
            self.screen.client.forget_session(conv_id)

    async def new(self, arg: str = "") -> None:
        await self._open_conversation(None)

    async def branch(self, arg: str = "", at: int | None = None) -> None:
        if self.screen.conv is None:
            self.screen.notify("Nothing to branch yet.")
            return
        if at is None:
            focused = self.screen.focused if isinstance(self.screen.focused, MessageBox) else None
            if focused is not None:
                at = focused.message.id
            else:
                messages = self.screen.store.messages(self.screen.conv.id, limit=1)
                if not messages:
                    self.screen.notify("Nothing to branch yet.")
                    return
                at = messages[-1].id
        if self.screen.turn is not None and at >= self.screen.turn.id:
            self.screen.notify("Wait for the answer to finish before branching at it.", severity="warning")
            return
        new = self.screen.store.branch(self.screen.conv.id, at)
        await self._open_conversation(new.id)
        self.screen.notify(f"Branched into “{new.title}”.")

    async def rename(self, arg: str = "") -> None:
        if self.screen.conv is None:
            self.screen.notify("Send a message first; new chats are titled from it.")
            return
        if arg:
            await self._rename(arg)
            return
        self.screen.app.push_screen(TextPromptScreen("Rename conversation", self.screen.conv.title), self._rename)

    async def _rename(self, title: str | None) -> None:
        if title and title.strip() and self.screen.conv is not None:
            self.screen.conv = self.screen.store.update_conversation(self.screen.conv.id, title=title.strip())
            self.screen.set_title()
            self.screen.refresh_sidebar()

    async def delete(self, arg: str = "") -> None:
        target = self.screen.conv
        if target is None:
            return
        if self.screen.turn is not None and self.screen.turn.conversation_id == target.id:
            self.screen.notify("Stop the answer (Esc) before deleting this conversation.", severity="warning")
            return

        async def confirmed(yes: bool | None) -> None:
            if yes:
                self._deleted = self.screen.store.export_conversation(target.id)
                self.screen.store.delete_conversation(target.id)
                self.screen.run_worker(partial(self._forget, target.id), group="release", thread=True, exit_on_error=False)
                await self._open_conversation(None)
                self.screen.notify(f"Deleted “{target.title}”. /undo brings it back.")

        # /undo brings it back: Enter may confirm
        self.screen.app.push_screen(
            ConfirmScreen(f"Delete “{target.title}”?", yes="Delete conversation", enter_confirms=True), confirmed
        )

    async def undo(self, arg: str = "") -> None:
        if self._deleted is None:
            self.screen.notify("Nothing to undo.")
            return
        conv = self.screen.store.import_conversation(self._deleted)
        self._deleted = None
        await self._open_conversation(conv.id)
        self.screen.notify(f"Restored “{conv.title}”.")

    def search(self, arg: str = "") -> None:
        if self.screen.has_class("-narrow"):
            self.screen.add_class("-sidebar-open")
        self.screen.remove_class("-sidebar-hidden")
        self.screen.sidebar.search(arg)

    def settings(self, arg: str = "") -> None:
        settings = dict(self.screen.app.config.chat) if self.screen.conv is None else {**self.screen.app.config.chat, **self.screen.conv.settings}

        def saved(result: dict | None) -> None:
            if result is not None:
                self._save_settings(result)
                self.screen.notify("Settings saved for this conversation.")

        self.screen.app.push_screen(SettingsScreen(settings), saved)

    def _save_settings(self, settings: dict) -> None:
        if self.screen.conv is None:
            self.screen.conv = self.screen.store.create_conversation(
                model=self.screen.client.model_name if self.screen.client else self.screen.app.model_ref, settings=settings
            )
            self.screen.refresh_sidebar()
        else:
            self.screen.conv = self.screen.store.update_conversation(self.screen.conv.id, settings=settings)

    def system(self, arg: str = "") -> None:
        if not arg:
            self.settings()
            return
        current = dict(self.screen.app.config.chat) if self.screen.conv is None else {**self.screen.app.config.chat, **self.screen.conv.settings}
        self._save_settings(validate_settings({**current, "system_prompt": arg}))
        self.screen.notify("System prompt set for this conversation.")

    def preset(self, arg: str = "") -> None:
        try:
            presets = load_presets(self.screen.app.paths)
            if arg:
                self._apply_preset(find_preset(presets, arg.strip()).name, presets)
                return
        except UsageError as exc:
            self.screen.notify(str(exc), severity="warning", timeout=10)
            return

        def picked(name: str | None) -> None:
            if name:
                self._apply_preset(name, presets)

        self.screen.app.push_screen(PresetPickerScreen(presets), picked)

    def _apply_preset(self, name: str, presets) -> None:
        preset = presets[name]
        current = dict(self.screen.app.config.chat) if self.screen.conv is None else {**self.screen.app.config.chat, **self.screen.conv.settings}
        self._save_settings(preset.apply(current))
        current_model = self.screen.client.model_name if self.screen.client else self.screen.app.model_ref
        if preset.model and preset.model != current_model and self.turn_part.idle():
            self.screen.app.load_model(preset.model)
        self.screen.notify(f"Preset {name} applied to this conversation.")

    def model(self, arg: str = "") -> None:
        if not self.turn_part.idle():
            return
        if arg:
            self.screen.app.load_model(arg)
            return
        remote = getattr(self.screen.client, "list_models", None)
        current = self.screen.client.model_name if self.screen.client else self.screen.app.model_ref

        def picked(ref: str | None) -> None:
            if ref:
                self.screen.app.load_model(ref)

        try:
            names = remote() if remote else None
        except EdgechatError as exc:
            self.screen.notify(str(exc), severity="error")
            return
        pool = self.screen.app.local_models
        loaded: dict[str, tuple[str, int]] = pool.loaded() if pool is not None and names is None else {}
        self.screen.app.push_screen(ModelPickerScreen(self.screen.app.paths, current, names, loaded), picked)

    def export(self, arg: str = "") -> None:
        if self.screen.conv is None:
            self.screen.notify("Nothing to export yet.")
            return
        arg = arg.strip()
        fmt = "json" if arg.lower() == "json" or arg.endswith(".json") else "markdown"
        path: str | Path
        if arg and arg.lower() not in ("json", "md", "markdown"):
            path = arg
        else:
            slug = re.sub(r"[^a-z0-9]+", "-", self.screen.conv.title.lower()).strip("-")[:40] or "chat"
            path = self.screen.app.paths.data / "exports" / f"{slug}-{self.screen.conv.id}.{'json' if fmt == 'json' else 'md'}"
        try:
            written = export_conversation(self.screen.store, self.screen.conv.id, path, fmt)
        except OSError as exc:
            self.screen.notify(f"Cannot write {path}: {exc.strerror}", severity="error")
            return
        self.screen.notify(f"Exported to {written}", timeout=8)

    def clear(self, arg: str = "") -> None:
        if self.screen.conv is None or not self.turn_part.idle():
            return
        conv = self.screen.conv

        async def confirmed(yes: bool | None) -> None:
            first = self.screen.store.messages(conv.id)
            if yes and first:
                self.screen.store.delete_messages_from(conv.id, first[0].id)
                await self._open_conversation(conv.id)

        self.screen.app.push_screen(ConfirmScreen(f"Remove every message of “{conv.title}”?", yes="Clear"), confirmed)

    def _copy(self, text: str, what: str) -> None:
        self.screen.app.copy_to_clipboard(text)
        # OSC 52 is silently ignored by some terminals: keep a file copy as well.
        fallback = self.screen.app.paths.data / "clipboard.txt"
        try:
            atomic_write_text(fallback, text)
            self.screen.notify(f"Copied {what} (also in {fallback}).")
        except OSError:
            self.screen.notify(f"Copied {what}.")

    def _last_answer(self) -> str | None:
        if self.screen.conv is None:
            return None
        if self.screen.turn is not None and self.screen.turn.conversation_id == self.screen.conv.id:
            return self.screen.turn.text
        answer = next((m for m in reversed(self.screen.store.messages(self.screen.conv.id)) if m.role == "assistant"), None)
        return answer.content if answer else None

    def copy(self, arg: str = "") -> None:
        text = self._last_answer()
        if text:
            self._copy(text, "the last answer")
        else:
            self.screen.notify("No answer to copy yet.")

    def copy_code(self, arg: str = "") -> None:
        blocks = _CODE_BLOCK.findall(self._last_answer() or "")
        if blocks:
            self._copy(blocks[-1], "the code block")
        else:
            self.screen.notify("The last answer has no code block.")

    def toggle_sidebar(self, arg: str = "") -> None:
        if self.screen.has_class("-narrow"):
            self.screen.toggle_class("-sidebar-open")
        else:
            self.screen.toggle_class("-sidebar-hidden")

    def toggle_stats(self, arg: str = "") -> None:
        self.screen.chat.toggle_class("-show-stats")

    def toggle_thoughts(self, arg: str = "") -> None:
        """Expand or collapse the thoughts of the focused answer, else of the last answer that has some."""
        focused = self.screen.focused if isinstance(self.screen.focused, MessageBox) else None
        boxes = [focused] if focused is not None else list(reversed(self.screen.chat.boxes()))
        thoughts = next((b.thoughts for b in boxes if b.thoughts is not None and b.thoughts.text), None)
        if thoughts is None:
            self.screen.notify("No thoughts to show: the answers here came without any.")
            return
        thoughts.toggle()

    def theme(self, arg: str = "") -> None:
        if arg:
            if arg in self.screen.app.available_themes:
                self.screen.app.theme = arg
            else:
                self.screen.notify(f"Unknown theme {arg}; themes: {', '.join(sorted(self.screen.app.available_themes))}")
            return
        self.screen.app.search_themes()

    def speak(self, arg: str = "") -> None:
        word = arg.strip().lower()
        if word not in ("", "on", "off"):
            self.screen.notify("/speak on, /speak off, or /speak alone to switch", severity="warning")
            return
        on = not self.screen.voice.reading if not word else word == "on"
        if not on:
            self.screen.voice.stop()
        self.screen.voice.reading = self.screen.app.config.speak = on
        save_tui_setting(self.screen.app.paths, "speak", on)
        self.screen.notify("Answers are read aloud (Esc silences one)." if on else "Answers are no longer read aloud.")

    def talk(self, arg: str = "") -> None:
        if self.screen.voice.listening:
            self.screen.notify("Writing down what you said…")
            self.screen.run_worker(self._write_down, group="talk", thread=True, exit_on_error=False)
            return
        try:
            self.screen.voice.listen()
        except EdgechatError as exc:
            self.screen.notify(str(exc), severity="error", timeout=12)
            return
        self.screen.notify("Listening: F5 (or /talk) again when you are done.", timeout=30)

    def _write_down(self) -> None:
        try:
            said = self.screen.voice.heard()
        except EdgechatError as exc:
            self.screen.app.call_from_thread(self.screen.notify, str(exc), severity="error", timeout=12)
            return
        self.screen.app.call_from_thread(self._put_in_prompt, said)

    def _put_in_prompt(self, said: str) -> None:
        if not said:
            self.screen.notify("Nothing was heard.", severity="warning")
            return
        typed = self.screen.prompt.text.rstrip()
        self.screen.prompt.set_text(f"{typed} {said}" if typed else said)
        self.screen.prompt.focus()

    def help(self, arg: str = "") -> None:
        self.screen.app.push_screen(HelpScreen())

    async def quit(self, arg: str = "") -> None:
        await self.screen.app.action_quit()

    async def message_action(self, event: MessageBox.Action) -> None:
        """A message's own button: copy, edit, branch from it, regenerate."""
        msg = event.box.message
        if event.action == "copy":
            self._copy(event.box.text, "the message")
        elif event.action == "edit":
            if msg.role == "user":
                self.turn_part.edit_message(msg)
            else:
                self.screen.notify("Only your own messages can be edited; r regenerates an answer.")
        elif event.action == "branch":
            await self.branch(at=msg.id)
        elif event.action == "regenerate":
            await self.turn_part.regenerate()
