"""One line at the bottom: model, backend, context gauge, the last answer's TTFT, tok/s and share of
speculative guesses kept, memory in use."""

from __future__ import annotations

import os

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget


def process_memory() -> int | None:
    """Resident memory of this process in bytes (Linux and Android; None elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def gauge(used: int, size: int, width: int) -> str:
    filled = round(width * min(used, size) / size) if size else 0
    return "█" * filled + "░" * (width - filled)


class StatusBar(Widget):
    model = reactive("no model")
    backend = reactive("")
    #: "loading", "ready", "generating", "error"
    state = reactive("")
    context_used = reactive(0)
    context_size = reactive(0)
    ttft = reactive(0.0)
    tok_s = reactive(0.0)
    #: the last answer's drafted tokens that were kept, in percent; None when nothing was drafted
    spec: reactive[float | None] = reactive(None)
    memory = reactive(0)

    def on_mount(self) -> None:
        self._sample_memory()
        self.set_interval(2.0, self._sample_memory)

    def _sample_memory(self) -> None:
        self.memory = process_memory() or 0

    def render(self) -> Text:
        narrow = self.size.width < 70
        out = Text()
        if self.state and self.state != "ready":
            out.append(f" ({self.state})", style="italic")
        sep = " │ "
        if self.backend and not narrow:
            out.append(sep + self.backend)
        if self.context_size:
            out.append(sep + ("" if narrow else "ctx "))
            out.append(gauge(self.context_used, self.context_size, 6 if narrow else 10), style="bold")
            out.append(f" {self.context_used}/{self.context_size}")
        if self.ttft and not narrow:
            out.append(sep + f"TTFT {self.ttft:.2f}s")
        if self.tok_s:
            out.append(sep + f"{self.tok_s:.1f} tok/s")
        if self.spec is not None:
            out.append(sep + f"spec {self.spec:.0f}%")
        # A long model name gives way to the figures before memory: on a phone's 50 columns the
        # last answer's speed and acceptance matter more than the rest of a name the user chose.
        name = Text(self.model, style="bold")
        room = self.content_size.width - out.cell_len
        if name.cell_len > room:
            name.truncate(max(room, 6), overflow="ellipsis")
        if self.memory and not narrow:
            out.append(sep + f"mem {self.memory / 2**20:.0f} MB")
        return Text.assemble(name, out, no_wrap=True, overflow="ellipsis")
