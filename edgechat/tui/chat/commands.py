"""The slash commands and keys that belong to no other part: conversations (new, branch, rename,
delete, undo, clear, search), settings, system prompt and presets, the model, export, copying,
the sidebar, stats, thoughts and theme, help and quit; and a message's own buttons."""

from __future__ import annotations

import re
from pathlib import Path

from textual import on, work
from textual.widgets import Button

from edgechat.errors import EdgechatError, UsageError
from edgechat.store import atomic_write_text, export_conversation
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.config import save_tui_setting, validate_settings
from edgechat.tui.presets import find_preset, load_presets
from edgechat.tui.screens.dialogs import ConfirmScreen, TextPromptScreen
from edgechat.tui.screens.help import HelpScreen
from edgechat.tui.screens.models import ModelPickerScreen
from edgechat.tui.screens.pickers import PresetPickerScreen
from edgechat.tui.screens.settings import SettingsScreen
from edgechat.tui.widgets.chatview import MessageBox

_CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)


class CommandsPart(ChatBase):
    @work(thread=True, group="release", exit_on_error=False)
    def _forget(self, conv_id: str) -> None:
        if self.client is not None:
            self.client.forget_session(conv_id)

    async def action_new(self, arg: str = "") -> None:
        await self.open_conversation(None)

    async def action_branch(self, arg: str = "", at: int | None = None) -> None:
        if self.conv is None:
            self.notify("Nothing to branch yet.")
            return
        if at is None:
            focused = self.focused if isinstance(self.focused, MessageBox) else None
            if focused is not None:
                at = focused.message.id
            else:
                messages = self.store.messages(self.conv.id, limit=1)
                if not messages:
                    self.notify("Nothing to branch yet.")
                    return
                at = messages[-1].id
        if self.turn is not None and at >= self.turn.id:
            self.notify("Wait for the answer to finish before branching at it.", severity="warning")
            return
        new = self.store.branch(self.conv.id, at)
        await self.open_conversation(new.id)
        self.notify(f"Branched into “{new.title}”.")

    async def action_rename(self, arg: str = "") -> None:
        if self.conv is None:
            self.notify("Send a message first; new chats are titled from it.")
            return
        if arg:
            await self._rename(arg)
            return
        self.app.push_screen(TextPromptScreen("Rename conversation", self.conv.title), self._rename)

    async def _rename(self, title: str | None) -> None:
        if title and title.strip() and self.conv is not None:
            self.conv = self.store.update_conversation(self.conv.id, title=title.strip())
            self._set_title()
            self.refresh_sidebar()

    async def action_delete(self, arg: str = "") -> None:
        target = self.conv
        if target is None:
            return
        if self.turn is not None and self.turn.conversation_id == target.id:
            self.notify("Stop the answer (Esc) before deleting this conversation.", severity="warning")
            return

        async def confirmed(yes: bool | None) -> None:
            if yes:
                self._deleted = self.store.export_conversation(target.id)
                self.store.delete_conversation(target.id)
                self._forget(target.id)
                await self.open_conversation(None)
                self.notify(f"Deleted “{target.title}”. /undo brings it back.")

        # /undo brings it back: Enter may confirm
        self.app.push_screen(
            ConfirmScreen(f"Delete “{target.title}”?", yes="Delete conversation", enter_confirms=True), confirmed
        )

    async def action_undo(self, arg: str = "") -> None:
        if self._deleted is None:
            self.notify("Nothing to undo.")
            return
        conv = self.store.import_conversation(self._deleted)
        self._deleted = None
        await self.open_conversation(conv.id)
        self.notify(f"Restored “{conv.title}”.")

    def action_search(self, arg: str = "") -> None:
        if self.has_class("-narrow"):
            self.add_class("-sidebar-open")
        self.remove_class("-sidebar-hidden")
        self.sidebar.search(arg)

    def action_settings(self, arg: str = "") -> None:
        settings = dict(self.app.config.chat) if self.conv is None else {**self.app.config.chat, **self.conv.settings}

        def saved(result: dict | None) -> None:
            if result is not None:
                self._save_settings(result)
                self.notify("Settings saved for this conversation.")

        self.app.push_screen(SettingsScreen(settings), saved)

    def _save_settings(self, settings: dict) -> None:
        if self.conv is None:
            self.conv = self.store.create_conversation(
                model=self.client.model_name if self.client else self.app.model_ref, settings=settings
            )
            self.refresh_sidebar()
        else:
            self.conv = self.store.update_conversation(self.conv.id, settings=settings)

    def action_system(self, arg: str = "") -> None:
        if not arg:
            self.action_settings()
            return
        current = dict(self.app.config.chat) if self.conv is None else {**self.app.config.chat, **self.conv.settings}
        self._save_settings(validate_settings({**current, "system_prompt": arg}))
        self.notify("System prompt set for this conversation.")

    def action_preset(self, arg: str = "") -> None:
        try:
            presets = load_presets(self.app.paths)
            if arg:
                self._apply_preset(find_preset(presets, arg.strip()).name, presets)
                return
        except UsageError as exc:
            self.notify(str(exc), severity="warning", timeout=10)
            return

        def picked(name: str | None) -> None:
            if name:
                self._apply_preset(name, presets)

        self.app.push_screen(PresetPickerScreen(presets), picked)

    def _apply_preset(self, name: str, presets) -> None:
        preset = presets[name]
        current = dict(self.app.config.chat) if self.conv is None else {**self.app.config.chat, **self.conv.settings}
        self._save_settings(preset.apply(current))
        current_model = self.client.model_name if self.client else self.app.model_ref
        if preset.model and preset.model != current_model and self._idle():
            self.app.load_model(preset.model)
        self.notify(f"Preset {name} applied to this conversation.")

    def action_model(self, arg: str = "") -> None:
        if not self._idle():
            return
        if arg:
            self.app.load_model(arg)
            return
        remote = getattr(self.client, "list_models", None)
        current = self.client.model_name if self.client else self.app.model_ref

        def picked(ref: str | None) -> None:
            if ref:
                self.app.load_model(ref)

        try:
            names = remote() if remote else None
        except EdgechatError as exc:
            self.notify(str(exc), severity="error")
            return
        pool = self.app.local_models
        loaded: dict[str, tuple[str, int]] = pool.loaded() if pool is not None and names is None else {}
        self.app.push_screen(ModelPickerScreen(self.app.paths, current, names, loaded), picked)

    def action_export(self, arg: str = "") -> None:
        if self.conv is None:
            self.notify("Nothing to export yet.")
            return
        arg = arg.strip()
        fmt = "json" if arg.lower() == "json" or arg.endswith(".json") else "markdown"
        path: str | Path
        if arg and arg.lower() not in ("json", "md", "markdown"):
            path = arg
        else:
            slug = re.sub(r"[^a-z0-9]+", "-", self.conv.title.lower()).strip("-")[:40] or "chat"
            path = self.app.paths.data / "exports" / f"{slug}-{self.conv.id}.{'json' if fmt == 'json' else 'md'}"
        try:
            written = export_conversation(self.store, self.conv.id, path, fmt)
        except OSError as exc:
            self.notify(f"Cannot write {path}: {exc.strerror}", severity="error")
            return
        self.notify(f"Exported to {written}", timeout=8)

    def action_clear(self, arg: str = "") -> None:
        if self.conv is None or not self._idle():
            return
        conv = self.conv

        async def confirmed(yes: bool | None) -> None:
            first = self.store.messages(conv.id)
            if yes and first:
                self.store.delete_messages_from(conv.id, first[0].id)
                await self.open_conversation(conv.id)

        self.app.push_screen(ConfirmScreen(f"Remove every message of “{conv.title}”?", yes="Clear"), confirmed)

    def _copy(self, text: str, what: str) -> None:
        self.app.copy_to_clipboard(text)
        # OSC 52 is silently ignored by some terminals: keep a file copy as well.
        fallback = self.app.paths.data / "clipboard.txt"
        try:
            atomic_write_text(fallback, text)
            self.notify(f"Copied {what} (also in {fallback}).")
        except OSError:
            self.notify(f"Copied {what}.")

    def _last_answer(self) -> str | None:
        if self.conv is None:
            return None
        if self.turn is not None and self.turn.conversation_id == self.conv.id:
            return self.turn.text
        answer = next((m for m in reversed(self.store.messages(self.conv.id)) if m.role == "assistant"), None)
        return answer.content if answer else None

    def action_copy(self, arg: str = "") -> None:
        text = self._last_answer()
        if text:
            self._copy(text, "the last answer")
        else:
            self.notify("No answer to copy yet.")

    def action_copy_code(self, arg: str = "") -> None:
        blocks = _CODE_BLOCK.findall(self._last_answer() or "")
        if blocks:
            self._copy(blocks[-1], "the code block")
        else:
            self.notify("The last answer has no code block.")

    def action_toggle_sidebar(self, arg: str = "") -> None:
        if self.has_class("-narrow"):
            self.toggle_class("-sidebar-open")
        else:
            self.toggle_class("-sidebar-hidden")

    @on(Button.Pressed, "#toggle-sidebar")
    @on(Button.Pressed, "#close-sidebar")
    def _toggle_pressed(self) -> None:
        self.action_toggle_sidebar()

    def action_toggle_stats(self, arg: str = "") -> None:
        self.chat.toggle_class("-show-stats")

    def action_toggle_thoughts(self, arg: str = "") -> None:
        """Expand or collapse the thoughts of the focused answer, else of the last answer that has some."""
        focused = self.focused if isinstance(self.focused, MessageBox) else None
        boxes = [focused] if focused is not None else list(reversed(self.chat.boxes()))
        thoughts = next((b.thoughts for b in boxes if b.thoughts is not None and b.thoughts.text), None)
        if thoughts is None:
            self.notify("No thoughts to show: the answers here came without any.")
            return
        thoughts.toggle()

    def action_theme(self, arg: str = "") -> None:
        if arg:
            if arg in self.app.available_themes:
                self.app.theme = arg
            else:
                self.notify(f"Unknown theme {arg}; themes: {', '.join(sorted(self.app.available_themes))}")
            return
        self.app.search_themes()

    def action_speak(self, arg: str = "") -> None:
        word = arg.strip().lower()
        if word not in ("", "on", "off"):
            self.notify("/speak on, /speak off, or /speak alone to switch", severity="warning")
            return
        on = not self.voice.reading if not word else word == "on"
        if not on:
            self.voice.stop()
        self.voice.reading = self.app.config.speak = on
        save_tui_setting(self.app.paths, "speak", on)
        self.notify("Answers are read aloud (Esc silences one)." if on else "Answers are no longer read aloud.")

    def action_talk(self, arg: str = "") -> None:
        if self.voice.listening:
            self.notify("Writing down what you said…")
            self._write_down()
            return
        try:
            self.voice.listen()
        except EdgechatError as exc:
            self.notify(str(exc), severity="error", timeout=12)
            return
        self.notify("Listening: F5 (or /talk) again when you are done.", timeout=30)

    @work(thread=True, group="talk", exit_on_error=False)
    def _write_down(self) -> None:
        try:
            said = self.voice.heard()
        except EdgechatError as exc:
            self.app.call_from_thread(self.notify, str(exc), severity="error", timeout=12)
            return
        self.app.call_from_thread(self._put_in_prompt, said)

    def _put_in_prompt(self, said: str) -> None:
        if not said:
            self.notify("Nothing was heard.", severity="warning")
            return
        typed = self.prompt.text.rstrip()
        self.prompt.set_text(f"{typed} {said}" if typed else said)
        self.prompt.focus()

    def action_help(self, arg: str = "") -> None:
        self.app.push_screen(HelpScreen())

    async def action_quit(self, arg: str = "") -> None:
        await self.app.action_quit()

    @on(MessageBox.Action)
    async def _message_action(self, event: MessageBox.Action) -> None:
        msg = event.box.message
        if event.action == "copy":
            self._copy(event.box.text, "the message")
        elif event.action == "edit":
            if msg.role == "user":
                self.edit_message(msg)
            else:
                self.notify("Only your own messages can be edited; r regenerates an answer.")
        elif event.action == "branch":
            await self.action_branch(at=msg.id)
        elif event.action == "regenerate":
            await self.action_regenerate()
