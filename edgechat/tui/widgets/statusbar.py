"""One line at the bottom: model, what it holds in memory, backend, context gauge, the last answer's TTFT, tok/s and share of
speculative guesses kept, memory in use; what does not fit the width is left out, least useful first."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from edgechat.sysmem import process_rss

#: between the parts of the line
SEP = " │ "
#: the fewest columns of the model's name kept before figures are dropped
NAME_MIN = 12
#: what gives way first when the line is too wide. A long name's rest ("name") goes before the
#: figures: on a phone's 50 columns the last answer's speed and guesses matter more. The model's
#: own memory outlasts the process's (which counts the other models the app keeps loaded too).
DROP_ORDER = ("backend", "memory", "model_memory", "ttft", "name", "context", "guessed", "speed", "gauge", "state")


def gauge(used: int, size: int, width: int) -> str:
    filled = round(width * min(used, size) / size) if size else 0
    return "█" * filled + "░" * (width - filled)


class StatusBar(Widget):
    model = reactive("no model")
    backend = reactive("")
    #: "loading", "ready", "thinking…" (a reasoning model before its answer), "generating", "error"
    state = reactive("")
    context_used = reactive(0)
    context_size = reactive(0)
    ttft = reactive(0.0)
    tok_s = reactive(0.0)
    #: the last answer's drafted tokens that were kept, in percent; None when nothing was drafted
    spec: reactive[float | None] = reactive(None)
    memory = reactive(0)
    #: what the model holds (the planner's weights + KV + compute); 0 when not known (remote)
    model_memory = reactive(0)

    def on_mount(self) -> None:
        self._sample_memory()
        self.set_interval(2.0, self._sample_memory)

    def _sample_memory(self) -> None:
        self.memory = process_rss() or 0

    def render(self) -> Text:
        narrow = self.size.width < 70
        # The parts in the order shown; when the line is too wide, they go whole in DROP_ORDER
        # (a part cut mid-way, "mem" with no figure, says nothing).
        parts: list[tuple[str, Text]] = []
        if self.state and self.state != "ready":
            parts.append(("state", Text(f" ({self.state})", style="italic")))
        if self.model_memory:
            parts.append(("model_memory", Text(SEP + f"model {self.model_memory / 2**20:.0f} MB")))
        if self.backend:
            parts.append(("backend", Text(SEP + self.backend)))
        if self.context_size:
            bar = Text(SEP + ("" if narrow else "ctx "))
            bar.append(gauge(self.context_used, self.context_size, 6 if narrow else 10), style="bold")
            parts.append(("gauge", bar))
            parts.append(("context", Text(f" {self.context_used}/{self.context_size}")))
        if self.ttft:
            parts.append(("ttft", Text(SEP + f"TTFT {self.ttft:.2f}s")))
        if self.tok_s:
            parts.append(("speed", Text(SEP + f"{self.tok_s:.1f} tok/s")))
        if self.spec is not None:
            parts.append(("guessed", Text(SEP + f"guessed {self.spec:.0f}%")))
        if self.memory:
            parts.append(("memory", Text(SEP + f"mem {self.memory / 2**20:.0f} MB")))
        name = Text(self.model, style="bold")
        floor = min(name.cell_len, NAME_MIN)
        # the name's columns past NAME_MIN count as one more part
        parts.append(("name", Text(" " * (name.cell_len - floor))))
        width = self.content_size.width
        while parts and floor + sum(t.cell_len for _, t in parts) > width:
            parts.remove(min(parts, key=lambda p: DROP_ORDER.index(p[0])))
        shown = [t for key, t in parts if key != "name"]
        room = width - sum(t.cell_len for t in shown)
        if name.cell_len > room:
            name.truncate(max(room, floor), overflow="ellipsis")
        return Text.assemble(name, *shown, no_wrap=True, overflow="ellipsis")
