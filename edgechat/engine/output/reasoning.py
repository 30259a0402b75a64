"""Reasoning models: which markers a chat template uses around the model's thoughts, and the
splitters that tell thoughts from the answer as text streams out.

A template that mentions a known pair of markers (`<think>`/`</think>`: Qwen3, DeepSeek-R1 and
its distills, SmolLM3, Phi-4-mini-reasoning; `[THINK]`/`[/THINK]`: Magistral) makes the model a
reasoning model; one that mentions `enable_thinking` takes that switch. Whether a prompt has
already opened the block (R1-style generation prompts end with `<think>\\n`) is read off the
rendered prompt itself, since the switch changes it.

gpt-oss writes OpenAI's harmony format instead: every message is
`<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>`, thoughts in the `analysis` channel, the
answer in `final`, tool calls in `commentary` with a recipient (`to=functions.NAME`). Its markers
are special tokens, so they are told apart by token id (`ChannelSplitter`): ordinary tokens
that spell `<|channel|>` are text. llama.cpp renders four of them (`<|channel|>`, `<|message|>`,
`<|start|>`, `<|constrain|>`) and `<|end|>` as their text (it marks them user-defined so that its
own chat parser sees them) and ends generation at `<|return|>` and `<|call|>`; the splitter reads
the ids, so it works whether a marker renders as its text or as nothing.

Each format answers the same questions: the template's switch, whether a prompt's tail leaves
the model inside its thoughts (`opened_by`), what the engine writes to end them (`closing`) or to
skip them (`skip`), an earlier answer without them (`strip_thoughts`), and a splitter per request
(`splitters`).
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from edgechat.engine.output.markers import marker_tail

log = logging.getLogger(__name__)

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

    def skip(self, prompt_tail: str) -> str | None:
        """What a prompt ending in `prompt_tail` gets so the model writes no thoughts, where the
        template has no switch: the block its generation prompt opened, closed at once."""
        return self.closing if self.opened_by(prompt_tail) else None

    def strip_thoughts(self, content: str) -> str:
        """An earlier answer without its thoughts (a client may send them back in the content, with
        or without the start marker an R1-style prompt wrote): what history gives the model again."""
        at = content.find(self.end)
        return content if at == -1 else content[at + len(self.end):].lstrip()

    def splitters(self, tokenize: Callable[[str], list[int]]) -> Callable[[bool, list[int]], ReasoningSplitter]:
        """A new splitter per request, from whether its prompt opened the block (and its tokens)."""
        return lambda opened, prompt: ReasoningSplitter(self, opened)


@dataclass(frozen=True)
class ChannelFormat:
    """OpenAI's harmony format (gpt-oss); the fields are its markers and channel names, so a
    test can stand other special tokens in for them."""

    start: str = "<|start|>"
    channel: str = "<|channel|>"
    message: str = "<|message|>"
    end: str = "<|end|>"
    constrain: str = "<|constrain|>"
    thoughts: str = "analysis"
    answer: str = "final"
    #: gpt-oss's template takes `reasoning_effort` (low, medium, high) but has no off switch
    switch: str | None = None

    @property
    def markers(self) -> tuple[str, str, str, str, str]:
        return self.start, self.channel, self.message, self.end, self.constrain

    def opened_by(self, prompt_tail: str) -> bool:
        return prompt_tail.rstrip().endswith(f"{self.channel}{self.thoughts}{self.message}")

    @property
    def closing(self) -> str:
        """The thoughts' message ended and the answer's begun, as the model would write them."""
        return f"{self.end}{self.start}assistant{self.channel}{self.answer}{self.message}"

    def skip(self, prompt_tail: str) -> str | None:
        """The model picks its channel after `<|start|>assistant`: the prompt picks `final`."""
        tail = prompt_tail.rstrip()
        if self.opened_by(tail):
            return self.closing
        return f"{self.channel}{self.answer}{self.message}" if tail.endswith(f"{self.start}assistant") else None

    def strip_thoughts(self, content: str) -> str:
        """What a client sent back with its markup (raw text, `--reasoning-format none`): the final
        message's text alone, as gpt-oss's template renders earlier turns (it refuses contents
        holding channel markup). Thoughts cut off before any answer leave nothing."""
        opener = f"{self.channel}{self.answer}{self.message}"
        at = content.rfind(opener)
        if at == -1:
            return "" if self.channel in content else content
        return content[at + len(opener):].split(self.end, 1)[0].strip()

    def splitters(self, tokenize: Callable[[str], list[int]]) -> Callable[[bool, list[int]], ChannelSplitter] | None:
        """None when a marker is not one token of this vocabulary: the channels cannot be told by
        id, and the text is then the answer as it is."""
        ids = [tokenize(text) for text in self.markers]
        if any(len(t) != 1 for t in ids):
            log.warning("the chat template writes harmony channels, but the model's vocabulary lacks their tokens; "
                        "its thoughts stay in the answer")
            return None
        start, channel, message, end, constrain = (t[0] for t in ids)
        markers = ChannelMarkers(self, start, channel, message, end, constrain,
                                 tokenize(f"{self.channel}{self.thoughts}{self.message}"),
                                 tokenize(f"{self.channel}{self.answer}{self.message}"))
        return lambda opened, prompt: ChannelSplitter(markers, prompt)


class Thinking:
    """One engine's side of its model's reasoning, shared by both engines: a splitter for each
    request that wants its thoughts apart, and the tokens the engine writes to end them when a
    request's budget is spent (the caller puts them into the sequence, as if the model had)."""

    def __init__(self, fmt: ReasoningFormat | ChannelFormat | None, tokenize: Callable[[str], list[int]]):
        self.format = fmt
        self.closing = tokenize(fmt.closing) if fmt is not None else []
        self._splitters = fmt.splitters(tokenize) if fmt is not None else None

    def splitter(self, request, prep) -> ReasoningSplitter | ChannelSplitter | None:
        """For a chat request (a ChatRequest and its Prepared prompt) that splits its reasoning."""
        if self._splitters is None or request.messages is None or not request.split_reasoning:
            return None
        return self._splitters(prep.thinking, prep.tokens)

    @staticmethod
    def spent(request, proc) -> bool:
        """Whether the request's thinking budget is used up while its output is still thinking."""
        budget = request.reasoning_budget
        return budget is not None and proc.thinking and proc.reasoning_tokens >= budget


def reasoning_format(template_source: str | None) -> ReasoningFormat | ChannelFormat | None:
    """The reasoning markers a chat template uses; None for a model that does not think."""
    if not template_source:
        return None
    harmony = ChannelFormat()
    if harmony.channel in template_source and harmony.message in template_source:
        return harmony
    for start, end in MARKERS:
        if start in template_source and end in template_source:
            return ReasoningFormat(start, end, "enable_thinking" if "enable_thinking" in template_source else None)
    return None


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

    def feed(self, text: str, token: int | None = None) -> tuple[str, str]:
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



@dataclass(frozen=True)
class ChannelMarkers:
    """A ChannelFormat's markers as this vocabulary's token ids, and the token runs of the
    openers of the thoughts' message and of the answer's (how a prompt may end)."""

    fmt: ChannelFormat
    start: int
    channel: int
    message: int
    end: int
    constrain: int
    opens_thoughts: list[int]
    opens_answer: list[int]


class Route(enum.Enum):
    HEADER = "header"  # between <|start|> (or <|end|>) and <|message|>: markup, never shown
    REASONING = "reasoning"
    CONTENT = "content"


_NAME = re.compile(r"[^\s<]+")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class ChannelSplitter:
    """Harmony's messages by token id: an `analysis` message's text is reasoning; `final`'s and a
    preamble's (`commentary` with no recipient, shown to users) are content; a message to a
    recipient (a tool call) reaches the content as `<|channel|>CHANNEL to=RECIPIENT<|message|>ARGS`,
    its own markup, for the tool parser; headers and markers are never shown. The state at the
    start is what the prompt's last tokens leave: inside the thoughts, inside the answer, or
    reading the header the model writes after `<|start|>assistant`.

    A model that writes no header (a template that is not its own) is not held back for long:
    after HEADER_LIMIT characters of header its text is the answer; after a message, a header
    that long is markup gone astray (a turn the model made up) and is dropped."""

    HEADER_LIMIT = 256

    def __init__(self, markers: ChannelMarkers, prompt: list[int]):
        self.m = markers
        fmt = markers.fmt
        #: each marker's text, what its piece is where llama.cpp renders it
        self._marker_text = {markers.start: fmt.start, markers.end: fmt.end, markers.message: fmt.message,
                             markers.channel: fmt.channel, markers.constrain: fmt.constrain}
        self._header = ""
        self._any_message = True
        if prompt[-len(markers.opens_thoughts):] == markers.opens_thoughts:
            self.route = Route.REASONING
        elif prompt[-len(markers.opens_answer):] == markers.opens_answer or prompt[-1:] == [markers.message]:
            self.route = Route.CONTENT
        else:
            self.route, self._any_message = Route.HEADER, False

    @property
    def thinking(self) -> bool:
        return self.route is Route.REASONING

    def feed(self, text: str, token: int | None = None) -> tuple[str, str]:
        marker = self._marker_text.get(token) if token is not None else None
        if marker is None:
            return self._add(text)
        # the marker's piece (its text, or nothing if it is a control token) is markup; text
        # decoded before it (a character completed with it) is the message's
        out = self._add(text.removesuffix(marker))
        m = self.m
        if token == m.start or token == m.end:
            self.route, self._header = Route.HEADER, ""
        elif token == m.message:
            return self._open(out)
        elif self.route is Route.HEADER:  # <|channel|> or <|constrain|>: the header reads them
            self._header += marker
        elif token == m.channel:  # a header without <|start|>: a new message begins
            self.route, self._header = Route.HEADER, marker
        return out

    def _add(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        if self.route is Route.REASONING:
            return text, ""
        if self.route is Route.CONTENT:
            return "", text
        self._header += text
        if len(self._header) > self.HEADER_LIMIT:
            if self._any_message:  # markup gone astray after a message: never shown
                self._header = ""
                return "", ""
            self.route, held, self._header = Route.CONTENT, self._header, ""
            return "", held
        return "", ""

    def _open(self, before: tuple[str, str]) -> tuple[str, str]:
        """<|message|>: the header read so far says where the message's text goes."""
        fmt, header = self.m.fmt, self._header
        self._header, self._any_message = "", True
        named = _NAME.match(header.partition(fmt.channel)[2].lstrip())
        channel = named.group() if named else ""
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            self.route = Route.CONTENT
            return before[0], before[1] + f"{fmt.channel}{channel} to={recipient.group(1)}{fmt.message}"
        self.route = Route.REASONING if channel == fmt.thoughts else Route.CONTENT
        return before

    def finish(self) -> tuple[str, str]:
        """End of text: a header never closed is markup, unless the model wrote no message at all
        (then it is what the model said)."""
        held, self._header = self._header, ""
        return "", held if not self._any_message else ""
