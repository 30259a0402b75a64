"""Keys and slash commands, from the one action table."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Label, Markdown

from edgechat.attachments import LONG_PASTE
from edgechat.tui.actions import ACTIONS, key_label

_EXTRA = f"""
| Key | In the input |
|---|---|
| Enter | send |
| Ctrl+J | new line (also Shift+Enter where the terminal supports it) |
| Up / Down | earlier prompts (on the first / last line) |
| Ctrl+P | command palette |
| Paste | a file's path (or a file dropped on the terminal) attaches it; over {LONG_PASTE:,} characters becomes an attachment |

Focus a message (click it, or Tab): **c** copy, **e** edit and resend, **b** branch here, **r** regenerate,
**t** show or hide its thoughts (a reasoning model's; a click on their line does too).
"""


def _cell(text: str) -> str:
    # A bare | ends a table cell, even inside `code` (as in /export [json|PATH]).
    return text.replace("|", r"\|")


def help_markdown() -> str:
    rows = ["| Action | Key | Slash |", "|---|---|---|"]
    for a in ACTIONS:
        slash = f"`{a.slash}{' ' + a.arg if a.arg else ''}`" if a.slash else ""
        rows.append(f"| {_cell(a.title)} | {_cell(key_label(a.key))} | {_cell(slash)} |")
    return "\n".join(rows) + "\n" + _EXTRA


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,f1", "dismiss", "Close")]

    def __init__(self):
        super().__init__(classes="dialog-screen")

    def compose(self):
        with Vertical(classes="dialog help-dialog"):
            yield Label("edgechat help  (Esc closes)", classes="dialog-title")
            with VerticalScroll():
                yield Markdown(help_markdown())

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)
