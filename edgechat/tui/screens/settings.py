"""Per-conversation settings: system prompt, sampling, answer length, seed, context policy,
speculative decoding, the loop guard, a reasoning model's thinking."""

from __future__ import annotations

from textual import on
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, TextArea

from edgechat.errors import UsageError
from edgechat.params import ContextPolicy, SpeculativeMode, values
from edgechat.tui.config import validate_settings

#: the one-line settings: key, label, Input type
FIELDS = (
    ("temperature", "Temperature", "number"),
    ("top_k", "Top-k (0: off)", "integer"),
    ("top_p", "Top-p", "number"),
    ("min_p", "Min-p (0: off)", "number"),
    ("repeat_penalty", "Repeat penalty", "number"),
    ("presence_penalty", "Presence penalty", "number"),
    ("frequency_penalty", "Frequency penalty", "number"),
    ("max_tokens", "Max tokens", "integer"),
    ("seed", "Seed (empty: random)", "integer"),
    # a reasoning model's thoughts: on, off, or at most this many tokens (ChatRequest.reasoning_budget)
    ("thinking", "Think on/off/tokens", "text"),
)


def _text(value) -> str:
    return "" if value is None else str(value)


class SettingsScreen(ModalScreen[dict | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, settings: dict):
        super().__init__(classes="dialog-screen")
        self.settings = settings

    def compose(self):
        s = self.settings
        with Vertical(classes="dialog settings-dialog"):
            yield Label("Conversation settings", classes="dialog-title")
            with VerticalScroll():
                yield Label("System prompt")
                yield TextArea(_text(s.get("system_prompt")), id="system_prompt", soft_wrap=True)
                for key, label, kind in FIELDS:
                    with Horizontal(classes="field"):
                        yield Label(label)
                        yield Input(_text(s.get(key)), id=key, type=kind, compact=True)
                yield Label("Context policy (when the context is full)")
                yield Select(
                    [(v, v) for v in values(ContextPolicy)],
                    value=s.get("context_policy") or ContextPolicy.SHIFT.value,
                    allow_blank=False,
                    id="context_policy",
                    compact=True,
                )
                yield Label("Speculative decoding (same answers)")
                yield Select(
                    [(v, v) for v in values(SpeculativeMode)],
                    value=s.get("speculative") or SpeculativeMode.AUTO.value,
                    allow_blank=False,
                    id="speculative",
                    compact=True,
                )
                yield Checkbox("Stop an answer that only repeats itself", s.get("loop_guard", True), id="loop_guard",
                               compact=True)
            yield Label("", id="settings-error", markup=False)  # quotes what was typed
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", id="save", variant="primary", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def values(self) -> dict:
        return {
            **self.settings,
            "system_prompt": self.query_one("#system_prompt", TextArea).text,
            **{key: self.query_one(f"#{key}", Input).value for key, _, _ in FIELDS},
            "context_policy": self.query_one("#context_policy", Select).value,
            "speculative": self.query_one("#speculative", Select).value,
            "loop_guard": self.query_one("#loop_guard", Checkbox).value,
        }

    @on(Button.Pressed, "#save")
    def save(self) -> None:
        try:
            self.dismiss(validate_settings(self.values()))
        except UsageError as exc:
            self.query_one("#settings-error", Label).update(str(exc))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
