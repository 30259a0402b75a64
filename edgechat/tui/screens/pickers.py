"""Two small pickers: files to attach (a path, glob or directory typed, or a file picked from a
tree) and presets (a list; their text is the user's, shown as written)."""

from __future__ import annotations

import shlex
from pathlib import Path

from rich.text import Text
from textual import on
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Label, OptionList
from textual.widgets.option_list import Option

from edgechat.tui.presets import Preset


class AttachPickerScreen(ModalScreen[str | None]):
    """Dismissed with what /attach takes (a shell-quoted path), or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, root: Path):
        super().__init__(classes="dialog-screen")
        self.root = root

    def compose(self):
        with Vertical(classes="dialog picker-dialog"):
            yield Label("Attach files  (Esc cancels)", classes="dialog-title")
            yield Input(placeholder="path, glob or folder; Enter attaches", id="attach-path")
            yield DirectoryTree(self.root, id="attach-tree")

    @on(Input.Submitted)
    def _typed(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    @on(DirectoryTree.FileSelected)
    def _picked(self, event: DirectoryTree.FileSelected) -> None:
        self.dismiss(shlex.quote(str(event.path)))

    def action_cancel(self) -> None:
        self.dismiss(None)


class PresetPickerScreen(ModalScreen[str | None]):
    """Dismissed with the picked preset's name, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, presets: dict[str, Preset]):
        super().__init__(classes="dialog-screen")
        self.presets = presets

    def compose(self):
        with Vertical(classes="dialog picker-dialog"):
            yield Label("Preset for this conversation  (Esc cancels)", classes="dialog-title")
            yield OptionList(
                *(Option(Text(f"{p.name} · {p.description}" if p.description else p.name), id=p.name)
                  for _, p in sorted(self.presets.items())),
                id="preset-list",
            )

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
