"""Small modal dialogs: confirm, and ask for one line of text."""

from __future__ import annotations

from textual import on
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("escape", "answer(False)", "Cancel"), Binding("y", "answer(True)", "Yes", show=False)]

    def __init__(self, question: str, yes: str = "Yes", enter_confirms: bool = False):
        super().__init__(classes="dialog-screen")
        self.question = question
        #: the confirm button's label: what it does ("Delete conversation"), not "Yes"
        self.yes = yes
        #: focus starts on the confirm button, so Enter does it; only for what can be undone
        self.enter_confirms = enter_confirms

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self.question, classes="dialog-title", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.yes, id="yes", variant="error", compact=True)
                yield Button("Cancel", id="no", compact=True)

    def on_mount(self) -> None:
        self.query_one("#yes" if self.enter_confirms else "#no", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


class TextPromptScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = "", placeholder: str = ""):
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.value = value
        self.placeholder = placeholder

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            yield Input(self.value, placeholder=self.placeholder, id="text")

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ToolApprovalScreen(ModalScreen[str]):
    """May the model's tool call run? "yes", "no", "always" (this tool, in this conversation) or,
    with Esc, "stop" (no more calls this turn)."""

    BINDINGS = [
        Binding("y", "answer('yes')", "Yes", show=False),
        Binding("n", "answer('no')", "No", show=False),
        Binding("a", "answer('always')", "Always", show=False),
        Binding("escape", "answer('stop')", "Stop"),
    ]

    def __init__(self, line: str):
        super().__init__(classes="dialog-screen")
        self.line = line

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Run this tool call?", classes="dialog-title")
            yield Label(self.line, classes="tool-call-line", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Yes", id="yes", variant="primary", compact=True)
                yield Button("No", id="no", compact=True)
                yield Button("Always", id="always", compact=True)

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)

    def action_answer(self, value: str) -> None:
        self.dismiss(value)
