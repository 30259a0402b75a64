"""The conversation: one box per message, and the worker that streams an answer into the last one.

Rendering keeps up with decoding by doing a bounded amount of UI work per second: the worker
thread gathers the engine's text deltas and posts them at most every FLUSH_INTERVAL, and the
Markdown widget re-parses only its last block on each append. Some blocks cost more to update as
they grow (Textual re-mounts every item of a list), so the interval also stretches until the UI
thread's CPU time stays under UI_SHARE of the wall time: each CPU second the UI spends is a second
the decoding threads do not get on a small machine.
"""

from __future__ import annotations

import threading
import time

from textual import on, work
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Button, Label, Markdown, Static

from edgechat.attachments import file_size, split
from edgechat.engine.types.request import (
    ChatRequest,
    Evicted,
    Finished,
    Metrics,
    RequestMetrics,
    TextDelta,
)
from edgechat.errors import EdgechatError
from edgechat.store import Message as StoredMessage
from edgechat.store import image_names
from edgechat.tui.client import ChatClient, Handle
from edgechat.tui.toolrun import call_line

#: seconds between UI updates while an answer streams (per-token updates halve decode speed)
FLUSH_INTERVAL = 0.15
#: the most of the UI thread's time that showing a streaming answer may take
UI_SHARE = 0.05
#: however costly an update, the text moves at least this often
MAX_INTERVAL = 1.0
#: messages shown when a conversation opens; older ones load on request
PAGE = 40

_ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System"}


def stats_text(msg: StoredMessage) -> str:
    parts = [time.strftime("%Y-%m-%d %H:%M", time.localtime(msg.created_at))]
    meta = msg.meta
    if meta.get("ttft") is not None:
        parts.append(f"TTFT {meta['ttft']:.2f}s")
    if meta.get("tok_s"):
        parts.append(f"{meta['tok_s']:.1f} tok/s")
    if meta.get("completion_tokens"):
        parts.append(f"{meta['completion_tokens']} tokens")
    if meta.get("model"):
        parts.append(meta["model"])
    return " · ".join(parts)


def thought_summary(seconds: float | None, tokens: int | None) -> str:
    """The one line collapsed thoughts show: "thought for 12 s, 340 tokens"."""
    parts = []
    if seconds is not None:
        if seconds >= 60:
            parts.append(f"thought for {int(seconds // 60)} min {int(seconds % 60)} s")
        else:
            parts.append(f"thought for {seconds:.0f} s" if seconds >= 10 else f"thought for {seconds:.1f} s")
    if tokens:
        parts.append(f"{tokens} token{'s' if tokens != 1 else ''}")
    return ", ".join(parts) if parts else "thoughts"


class Thoughts(Vertical):
    """A reasoning model's thoughts above its answer: shown in full, dimmed, while they stream;
    one line ("thought for 12 s, 340 tokens") once the answer starts. A click, t on the message
    or F3 expands and collapses them."""

    def __init__(self, text: str = "", summary: str = "", thinking: bool = False):
        super().__init__(classes="thoughts")
        self.text = text
        #: still streaming: shown whole, headed "thinking…"
        self.thinking = thinking
        self.summary = summary
        self.expanded = thinking
        self._update_classes()

    def compose(self):
        yield Static(self._line(), classes="thoughts-line", markup=False)
        yield Static(self.text, classes="thoughts-text", markup=False)

    def _line(self) -> str:
        if self.thinking:
            return "▾ thinking…"
        return ("▾ " if self.expanded else "▸ ") + self.summary

    def _update_classes(self) -> None:
        self.set_class(not self.text, "-empty")
        self.set_class(self.expanded, "-expanded")

    def _refresh(self) -> None:
        self._update_classes()
        if self.is_mounted:
            self.query_one(".thoughts-line", Static).update(self._line())

    def append(self, text: str) -> None:
        self.text += text
        if self.is_mounted:
            self.query_one(".thoughts-text", Static).update(self.text)
        self._refresh()

    def collapse(self, summary: str) -> None:
        """The answer started (or ended): one line from now on."""
        self.thinking, self.expanded, self.summary = False, False, summary
        self._refresh()

    def set_summary(self, summary: str) -> None:
        self.summary = summary
        self._refresh()

    def toggle(self) -> None:
        if self.text:
            self.expanded = not self.expanded
            self._refresh()

    def on_mouse_down(self) -> None:
        # On the press, not the click: the press focuses the message, whose border re-wraps the
        # view and moves this line from under the pointer before the button comes up.
        self.toggle()


class ToolCallBlock(Vertical):
    """One tool call an answer made: one line (the call and its outcome); a click shows what
    came back, and hides it again."""

    def __init__(self, call: dict):
        super().__init__(classes="tool-call")
        self.call = call
        self.expanded = False

    def compose(self):
        yield Static(self._line(), classes="tool-call-line", markup=False)
        yield Static(self.call["result"], classes="tool-call-result", markup=False)

    def _line(self) -> str:
        return ("▾ " if self.expanded else "▸ ") + "🔧 " + call_line(self.call)

    def update_call(self, call: dict) -> None:
        self.call = call
        self.query_one(".tool-call-line", Static).update(self._line())
        self.query_one(".tool-call-result", Static).update(call["result"])

    def toggle(self) -> None:
        self.expanded = not self.expanded
        self.set_class(self.expanded, "-expanded")
        self.query_one(".tool-call-line", Static).update(self._line())

    def on_mouse_down(self) -> None:
        self.toggle()


class MessageBox(Vertical, can_focus=True):
    """One message. Focus it (click, or Tab) for: c copy, e edit and resend, b branch here, r regenerate,
    t show or hide a reasoning model's thoughts."""

    BINDINGS = [
        Binding("c", "copy", "Copy"),
        Binding("e", "edit", "Edit & resend"),
        Binding("b", "branch", "Branch here"),
        Binding("r", "regenerate", "Regenerate"),
        Binding("t", "toggle_thoughts", "Thoughts"),
    ]

    class Action(Message):
        """The user asked for something on this message (copy, edit, branch, regenerate)."""

        def __init__(self, box: MessageBox, action: str):
            super().__init__()
            self.box = box
            self.action = action

    def __init__(self, message: StoredMessage, streaming: bool = False):
        super().__init__(classes=f"message -{message.role}")
        self.message = message
        #: an answer still arriving (stored as "interrupted" until it ends, shown as in progress)
        self.streaming = streaming
        self.text = message.content
        self._body: Markdown | Static | None = None
        self.thoughts: Thoughts | None = None
        self._set_status_class()

    def _set_status_class(self) -> None:
        self.set_class(not self.streaming and self.message.status == "interrupted", "-interrupted")
        self.set_class(not self.streaming and self.message.status == "error", "-error")

    def compose(self):
        label = _ROLE_LABELS.get(self.message.role, self.message.role)
        with Vertical(classes="message-header"):
            yield Label(label, classes="role")
            yield Label(stats_text(self.message), classes="stats", markup=False)
        if self.message.role == "assistant":
            # (hidden while empty: answers of models that do not think look as before)
            m = self.message
            still_thinking = self.streaming and not m.content and m.meta.get("thought_s") is None
            self.thoughts = Thoughts(m.reasoning, "" if still_thinking else self._summary(m), still_thinking)
            yield self.thoughts
            self._body = Markdown(self.text, classes="body")
        else:
            shown = self.text
            files = self.message.meta.get("attachments") or []
            images = self.message.images
            if files or images:
                # the files as chips, not their text (the message holds it: copy and the model get it)
                names = [f["name"] for f in files] + [f"{name} ({file_size(i.bytes)} image)"
                                                      for name, i in zip(image_names(self.message), images, strict=True)]
                yield Label("▪ " + " · ".join(names), classes="attached", markup=False)
                _, shown = split(self.text, len(files))
            self._body = Static(shown, markup=False, classes="body")
        yield self._body
        if self.message.role == "assistant":
            with Vertical(classes="tool-calls"):
                yield from (ToolCallBlock(c) for c in self.message.tool_calls)
        yield Label(self._status_note(), classes="status-note", markup=False)

    def _status_note(self) -> str:
        if self.streaming:
            return ""
        if self.message.status == "interrupted":
            return "(stopped)"
        if self.message.status == "error":
            return f"(error: {self.message.meta.get('error', 'failed')})"
        return ""

    @staticmethod
    def _summary(message: StoredMessage) -> str:
        return thought_summary(message.meta.get("thought_s"), message.meta.get("reasoning_tokens"))

    def append_thoughts(self, text: str) -> None:
        if self.thoughts is not None:
            self.thoughts.append(text)

    def thoughts_ended(self, seconds: float, tokens: int) -> None:
        """The answer started after the thoughts: fold them into one line."""
        if self.thoughts is not None:
            self.thoughts.collapse(thought_summary(seconds, tokens))

    async def append(self, text: str) -> None:
        self.text += text
        if isinstance(self._body, Markdown):
            await self._body.append(text)
        elif self._body is not None:
            self._body.update(self.text)

    def tool_blocks(self) -> list[ToolCallBlock]:
        return list(self.query(ToolCallBlock))

    async def show_tool_calls(self, calls: list[dict]) -> None:
        """The answer's calls as they stand (added, or each one's outcome)."""
        self.message.tool_calls = calls
        blocks = self.tool_blocks()
        for block, call in zip(blocks, calls, strict=False):  # the calls beyond the blocks are mounted below
            block.update_call(call)
        if len(calls) > len(blocks):
            await self.query_one(".tool-calls", Vertical).mount_all([ToolCallBlock(c) for c in calls[len(blocks):]])

    async def replace_text(self, text: str) -> None:
        """The answer's text as stored (the call syntax taken out)."""
        if text != self.text and isinstance(self._body, Markdown):
            self.text = text
            await self._body.update(text)

    def finish(self, message: StoredMessage) -> None:
        """The answer ended: show its final status and stats."""
        self.message = message
        self.streaming = False
        self._set_status_class()
        self.query_one(".stats", Label).update(stats_text(message))
        self.query_one(".status-note", Label).update(self._status_note())
        if self.thoughts is not None and self.thoughts.text:
            # the engine's own count of the thoughts' tokens, now that the answer ended
            if self.thoughts.thinking:
                self.thoughts.collapse(self._summary(message))
            else:
                self.thoughts.set_summary(self._summary(message))

    def action_toggle_thoughts(self) -> None:
        if self.thoughts is not None:
            self.thoughts.toggle()

    def action_copy(self) -> None:
        self.post_message(self.Action(self, "copy"))

    def action_edit(self) -> None:
        self.post_message(self.Action(self, "edit"))

    def action_branch(self) -> None:
        self.post_message(self.Action(self, "branch"))

    def action_regenerate(self) -> None:
        self.post_message(self.Action(self, "regenerate"))


class ChatView(VerticalScroll):
    """The messages of the open conversation, and the streaming of the answer being generated."""

    # One message class per engine event; the worker thread posts them, handlers run on the UI thread.
    class AnswerDelta(Message):
        def __init__(self, box: MessageBox, text: str, reasoning: bool = False):
            super().__init__()
            self.box = box
            self.text = text
            #: the model's thoughts, not its answer
            self.reasoning = reasoning

    class AnswerThoughtsEnded(Message):
        """The answer's first text came after its thoughts (or the answer ended while thinking)."""

        def __init__(self, box: MessageBox, seconds: float, tokens: int):
            super().__init__()
            self.box = box
            self.seconds = seconds
            #: thought deltas seen (about one a token; Finished's metrics have the exact count)
            self.tokens = tokens

    class AnswerEvicted(Message):
        def __init__(self, box: MessageBox, event: Evicted):
            super().__init__()
            self.box = box
            self.event = event

    class AnswerMetrics(Message):
        def __init__(self, box: MessageBox, metrics: RequestMetrics):
            super().__init__()
            self.box = box
            self.metrics = metrics

    class AnswerFinished(Message):
        def __init__(self, box: MessageBox, finished: Finished):
            super().__init__()
            self.box = box
            self.finished = finished

    class AnswerFailed(Message):
        """submit() refused the request (prompt too long, server busy): nothing was generated."""

        def __init__(self, box: MessageBox, error: str):
            super().__init__()
            self.box = box
            self.error = error

    class LoadEarlier(Message):
        pass

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._handle: Handle | None = None
        self._cancel = threading.Event()
        #: seconds between updates now; written on the UI thread, read by the worker
        self._interval = FLUSH_INTERVAL
        #: the UI thread's CPU time at the previous update
        self._mark: float | None = None
        #: Markdown shown while the conversation is empty ("" for nothing)
        self.welcome = ""

    # -- showing messages ------------------------------------------------

    async def show(self, messages: list[StoredMessage], total: int, streaming_id: int | None = None) -> None:
        """Replace what is shown: the newest `messages`, and a button for the `total - len` older ones."""
        with self.app.batch_update():
            await self.remove_children()
            widgets: list[Widget] = []
            if total > len(messages):
                widgets.append(Button(f"▲ {total - len(messages)} earlier messages", id="load-earlier"))
            widgets += [MessageBox(m, streaming=m.id == streaming_id) for m in messages]
            if not messages and self.welcome:
                widgets.append(Markdown(self.welcome, classes="welcome"))
            if widgets:
                await self.mount_all(widgets)
        self.scroll_end(animate=False, immediate=True)
        self.anchor()

    async def prepend(self, messages: list[StoredMessage], remaining: int) -> None:
        button = self.query("#load-earlier")
        first = self.query(MessageBox).first() if self.query(MessageBox) else None
        boxes = [MessageBox(m) for m in messages]
        if boxes:
            await self.mount_all(boxes, before=first)
        if remaining > 0:
            button.first(Button).label = f"▲ {remaining} earlier messages"
        else:
            await button.remove()

    @on(Button.Pressed, "#load-earlier")
    def _load_earlier(self, event: Button.Pressed) -> None:
        event.stop()
        self.post_message(self.LoadEarlier())

    async def set_welcome(self, text: str) -> None:
        self.welcome = text
        await self.query(".welcome").remove()
        if text and not self.boxes():
            await self.mount(Markdown(text, classes="welcome"))

    async def add(self, message: StoredMessage, streaming: bool = False) -> MessageBox:
        await self.query(".welcome").remove()
        box = MessageBox(message, streaming)
        await self.mount(box)
        self.scroll_end(animate=False)
        self.anchor()
        return box

    async def add_note(self, text: str, before: MessageBox | None = None) -> None:
        """A line between messages that is not part of the conversation (context evictions)."""
        await self.mount(Static(text, markup=False, classes="note"), before=before)

    def boxes(self) -> list[MessageBox]:
        return list(self.query(MessageBox))

    # -- streaming ---------------------------------------------------------

    def generate(self, client: ChatClient, request: ChatRequest, box: MessageBox) -> None:
        self._cancel.clear()
        self._handle = None
        self._interval = FLUSH_INTERVAL
        self._mark = None
        self._stream(client, request, box)

    def cancel(self) -> None:
        self._cancel.set()
        handle = self._handle
        if handle is not None:
            handle.cancel()

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)
    def _stream(self, client: ChatClient, request: ChatRequest, box: MessageBox) -> None:
        # Runs in a thread: only post_message from here, never touch widgets.
        try:
            handle = client.submit(request)
        except EdgechatError as exc:
            self.post_message(self.AnswerFailed(box, str(exc)))
            return
        self._handle = handle
        if self._cancel.is_set():
            handle.cancel()
        pending: list[str] = []
        thoughts: list[str] = []
        last = time.monotonic()
        #: when the first thought came, how many deltas of thoughts, whether the answer has started since
        think_start: float | None = None
        n_thoughts, thinking = 0, False

        def flush() -> None:
            # thoughts first: they come before the answer
            if thoughts:
                self.post_message(self.AnswerDelta(box, "".join(thoughts), reasoning=True))
                thoughts.clear()
            if pending:
                self.post_message(self.AnswerDelta(box, "".join(pending)))
                pending.clear()

        def end_thoughts() -> None:
            assert think_start is not None  # (only once a thought came)
            flush()
            self.post_message(self.AnswerThoughtsEnded(box, time.monotonic() - think_start, n_thoughts))

        for event in handle:
            if isinstance(event, TextDelta):
                if not event.text:
                    continue
                if event.reasoning:
                    if think_start is None:
                        think_start, thinking = time.monotonic(), True
                    n_thoughts += 1
                    thoughts.append(event.text)
                else:
                    if thinking:
                        thinking = False
                        end_thoughts()
                    # with tools, the call syntax never shows: the engine's text is the answer's words
                    pending.append(event.text)
                now = time.monotonic()
                if now - last >= self._interval:
                    flush()
                    last = now
            elif isinstance(event, Evicted):
                self.post_message(self.AnswerEvicted(box, event))
            elif isinstance(event, Metrics):
                self.post_message(self.AnswerMetrics(box, event.metrics))
            elif isinstance(event, Finished):
                if thinking:
                    end_thoughts()
                flush()
                self.post_message(self.AnswerFinished(box, event))

    @on(AnswerDelta)
    def _pace(self) -> None:
        # Runs before the screen applies this update: the CPU time since the previous one is what
        # that update cost the UI thread (append, layout, render). Space updates to keep it under UI_SHARE.
        cpu = time.thread_time()
        if self._mark is not None:
            self._interval = min(MAX_INTERVAL, max(FLUSH_INTERVAL, (cpu - self._mark) / UI_SHARE))
        self._mark = cpu

    @on(AnswerFinished)
    @on(AnswerFailed)
    def _on_end(self, message: Message) -> None:
        self._handle = None
