"""Reasoning models: which markers a chat template uses around the model's thoughts, and the
splitter that tells thoughts from the answer as text streams out.

A template that mentions a known pair of markers (`<think>`/`</think>`: Qwen3, DeepSeek-R1 and
its distills, SmolLM3, Phi-4-mini-reasoning; `[THINK]`/`[/THINK]`: Magistral) makes the model a
reasoning model; one that mentions `enable_thinking` takes that switch. Whether a prompt has
already opened the block (R1-style generation prompts end with `<think>\\n`) is read off the
rendered prompt itself, since the switch changes it. Not handled: gpt-oss's channels.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from edgechat.engine.stream import marker_tail

#: (start, end) pairs, most specific first
MARKERS = (("[THINK]", "[/THINK]"), ("<think>", "</think>"))


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    #: the template's own on/off variable (`enable_thinking`), if it has one
    switch: str | None = None

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` leaves the model inside an open block."""
        tail = prompt_tail.rstrip()
        return tail.endswith(self.start)

    @property
    def closing(self) -> str:
        """What the engine writes to end the thoughts itself (at a budget, or to switch them off)."""
        return f"{self.end}\n\n"


def reasoning_format(template_source: str | None) -> ReasoningFormat | None:
    """The reasoning markers a chat template uses; None for a model that does not think."""
    if not template_source:
        return None
    for start, end in MARKERS:
        if start in template_source and end in template_source:
            return ReasoningFormat(start, end, "enable_thinking" if "enable_thinking" in template_source else None)
    return None


def strip_thoughts(content: str, fmt: ReasoningFormat) -> str:
    """An earlier answer without its thoughts (a client may send them back in the content, with
    or without the start marker an R1-style prompt wrote): what history gives the model again."""
    at = content.find(fmt.end)
    return content if at == -1 else content[at + len(fmt.end):].lstrip()


class Phase(enum.Enum):
    MAYBE = "maybe"  # nothing but whitespace yet: the model may still open a block
    THINKING = "thinking"
    AFTER = "after"  # the block just closed: whitespace before the answer is dropped
    CONTENT = "content"


class ReasoningSplitter:
    """Decoded text in, (reasoning, content) out, markers cut across any chunk boundary held
    back until they are whole. A block counts only at the start of an answer."""

    def __init__(self, fmt: ReasoningFormat, opened: bool):
        self.fmt = fmt
        self.phase = Phase.THINKING if opened else Phase.MAYBE
        self._pending = ""
        self._started = False  # any thought written yet

    @property
    def thinking(self) -> bool:
        return self.phase is Phase.THINKING

    def feed(self, text: str) -> tuple[str, str]:
        buf, reasoning = self._pending + text, ""
        self._pending = ""
        while True:
            if self.phase is Phase.MAYBE:
                lead = buf.lstrip()
                if lead.startswith(self.fmt.start):
                    self.phase, buf = Phase.THINKING, lead[len(self.fmt.start):]
                    continue
                if self.fmt.start.startswith(lead):  # whitespace, or part of the start marker
                    self._pending = buf
                    return reasoning, ""
                self.phase = Phase.CONTENT
                return reasoning, lead
            if self.phase is Phase.THINKING:
                if not self._started:
                    # the whitespace a prompt or the model writes after the start marker is not a thought
                    buf = buf.lstrip()
                    self._started = bool(buf)
                at = buf.find(self.fmt.end)
                if at != -1:
                    reasoning += buf[:at]
                    self.phase, buf = Phase.AFTER, buf[at + len(self.fmt.end):]
                    continue
                keep = marker_tail(buf, self.fmt.end)
                self._pending = buf[len(buf) - keep:]
                return reasoning + buf[: len(buf) - keep], ""
            if self.phase is Phase.AFTER:
                lead = buf.lstrip()
                if not lead:
                    return reasoning, ""
                self.phase = Phase.CONTENT
                return reasoning, lead
            return reasoning, buf

    def finish(self) -> tuple[str, str]:
        """End of text: unfinished thoughts stay thoughts; a half marker is what it looked like."""
        held, self._pending = self._pending, ""
        if self.phase is Phase.THINKING:
            return held, ""
        return "", held if self.phase is Phase.MAYBE else ""

