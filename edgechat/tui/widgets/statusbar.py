"""One line at the bottom: model, backend, context gauge, last TTFT and tok/s, memory in use."""

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
    memory = reactive(0)

    def on_mount(self) -> None:
        self._sample_memory()
        self.set_interval(2.0, self._sample_memory)

    def _sample_memory(self) -> None:
        self.memory = process_memory() or 0

    def render(self) -> Text:
        narrow = self.size.width < 70
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append(self.model, style="bold")
        if self.state and self.state != "ready":
            out.append(f" ({self.state})", style="italic")
        sep = " │ "
        if self.backend and not narrow:
            out.append(sep + self.backend)
        if self.context_size:
            out.append(sep + ("" if narrow else "ctx "))
            out.append(gauge(self.context_used, self.context_size, 6 if narrow else 10), style="bold")
            out.append(f" {self.context_used}/{self.context_size}")
        if self.ttft:
            out.append(sep + f"TTFT {self.ttft:.2f}s")
        if self.tok_s:
            out.append(sep + f"{self.tok_s:.1f} tok/s")
        if self.memory and not narrow:
            out.append(sep + f"mem {self.memory / 2**20:.0f} MB")
        return out
