"""The main screen: sidebar, conversation, input and status bar, and every action on them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shlex
from pathlib import Path

from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, Footer, Label, TextArea
from textual.worker import Worker, WorkerState, get_current_worker

from edgechat import attachments
from edgechat.engine.params import ContextPolicy
from edgechat.engine.request import ChatRequest
from edgechat.engine.tools import tool_grammar
from edgechat.errors import EdgechatError, StoreError, UsageError
from edgechat.store import (
    DEFAULT_TITLE,
    Conversation,
    atomic_write_text,
    export_conversation,
    image_names,
    title_from,
)
from edgechat.store import Message as StoredMessage
from edgechat.store.answer import StoredAnswer
from edgechat.store.history import model_messages
from edgechat.tui.actions import ACTIONS, parse_slash, unknown_slash
from edgechat.tui.config import build_request, validate_settings
from edgechat.tui.presets import find_preset, load_presets
from edgechat.tui.screens.dialogs import ConfirmScreen, TextPromptScreen, ToolApprovalScreen
from edgechat.tui.screens.help import HelpScreen
from edgechat.tui.screens.models import ModelPickerScreen
from edgechat.tui.screens.pickers import AttachPickerScreen, PresetPickerScreen
from edgechat.tui.screens.settings import SettingsScreen
from edgechat.tui.toolrun import (
    CHOICES,
    DENIED,
    STOPPED,
    TOOL_STEPS,
    call_line,
    offered_tools,
    pending_call,
    split_name,
)
from edgechat.tui.welcome import welcome_markdown
from edgechat.tui.widgets.attachbar import AttachBar
from edgechat.tui.widgets.chatview import PAGE, ChatView, MessageBox
from edgechat.tui.widgets.prompt import PromptInput
from edgechat.tui.widgets.sidebar import Sidebar
from edgechat.tui.widgets.statusbar import StatusBar

#: below this width the sidebar becomes a toggle (phones in portrait, split panes)
NARROW = 70

_CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)


class ChatScreen(Screen):
    # (quit is the app's own binding)
    BINDINGS = [
        Binding(a.key, a.name, a.hint or a.title, show=bool(a.hint)) for a in ACTIONS if a.key and a.name != "quit"
    ]

    def __init__(self):
        super().__init__()
        self.conv: Conversation | None = None
        #: the answer being generated, wherever the user is looking meanwhile
        self.turn: StoredAnswer | None = None
        #: an answer waiting for the model to finish loading
        self._waiting: tuple[Conversation, StoredAnswer] | None = None
        #: the user message being edited (Enter resends from there)
        self._editing: int | None = None
        #: the last deleted conversation, for undo
        self._deleted: dict | None = None
        self._draft_timer = None
        #: the tools offered to the answer being generated (None: none)
        self._offered = None
        #: answers in a row that called tools since the question
        self._tool_steps = 0
        #: the worker running an answer's calls (asking, running), and whether Esc stopped them
        self._tool_run: Worker | None = None
        self._tools_stopped = False

    def notify(self, message: str, **kwargs) -> None:
        # The app's notify: messages here carry titles, model names and errors, never markup.
        self.app.notify(message, **kwargs)

    @property
    def store(self):
        return self.app.store

    @property
    def client(self):
        return self.app.client

    # -- layout --------------------------------------------------------------

    def compose(self):
        with Horizontal(id="body"):
            yield Sidebar(id="sidebar")
            with Vertical(id="main"):
                with Horizontal(id="topbar"):
                    yield Button("☰", id="toggle-sidebar", compact=True)
                    yield Label("New chat", id="conv-title", markup=False)
                yield ChatView(id="chat")
                yield AttachBar(id="attachments")
                yield PromptInput(id="prompt", placeholder="Message (Enter sends, Ctrl+J new line, /help)")
        yield StatusBar(id="status")
        yield Footer()

    @property
    def chat(self) -> ChatView:
        return self.query_one(ChatView)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def attach_bar(self) -> AttachBar:
        return self.query_one(AttachBar)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def sidebar(self) -> Sidebar:
        return self.query_one(Sidebar)

    def on_mount(self) -> None:
        self.set_class(self.app.size.width < NARROW, "-narrow")
        if self.client is None:
            self.status.model = self.app.model_ref or "model"
            self.status.state = "loading…"
        self.refresh_sidebar()
        self._welcome(self.app.model_ref)
        draft = self._draft_file()
        if draft.is_file():
            self.prompt.set_text(draft.read_text(encoding="utf-8"))
        self.prompt.focus()

    @work(thread=True, exclusive=True, group="welcome", exit_on_error=False)
    def _welcome(self, model_ref: str | None) -> None:
        # Reads free memory and the Hub cache: not on the UI thread, which draws the first frame.
        text = welcome_markdown(model_ref, self.app.paths)
        if not get_current_worker().is_cancelled:  # a model loaded since: its own call says what to show
            self.app.call_from_thread(self.chat.set_welcome, text)

    def _draft_file(self):
        return self.app.paths.data / "draft.txt"

    def _place_toasts(self) -> None:
        # Notifications stack up from just above the input (Textual puts them over the bottom
        # rows, where the input is: the text being edited was hidden). The input grows with its
        # text and the footer comes and goes with the width, so the gap is measured, not styled.
        above = self.prompt.region if self.prompt.region else self.status.region
        gap = self.size.height - above.y
        for rack in self.query("#textual-toastrack"):  # (none where notifications are off)
            if rack.styles.margin.bottom != gap:
                rack.styles.margin = (0, 0, gap, 0)

    @on(TextArea.Changed, "#prompt")
    def _prompt_changed(self) -> None:
        self.call_after_refresh(self._place_toasts)
        # Typed text survives a quit or a killed process: saved half a second after the last key.
        if self._draft_timer is not None:
            self._draft_timer.stop()
        self._draft_timer = self.set_timer(0.5, self._save_draft)

    def _save_draft(self) -> None:
        self._draft_timer = None
        text = self.prompt.text
        try:
            if text.strip():
                atomic_write_text(self._draft_file(), text)
            else:
                self._draft_file().unlink(missing_ok=True)
        except OSError as exc:
            self.notify(f"Cannot save the draft: {exc.strerror}", severity="warning")

    def on_resize(self, event) -> None:
        self.set_class(event.size.width < NARROW, "-narrow")
        self.call_after_refresh(self._place_toasts)

    def refresh_sidebar(self) -> None:
        self.sidebar.show_conversations(self.store.list_conversations(), self.conv.id if self.conv else None)

    def _set_title(self) -> None:
        self.query_one("#conv-title", Label).update(self.conv.title if self.conv else "New chat")

    # -- opening conversations ---------------------------------------------------

    async def open_conversation(self, conv_id: str | None) -> None:
        """Show a conversation (None: a fresh draft, stored once its first message is sent)."""
        previous = self.conv
        self._editing = None
        if conv_id is None:
            self.conv = None
            await self.chat.show([], 0)
        else:
            conv = self.store.get_conversation(conv_id)
            if conv is None:
                return
            self.conv = conv
            total = self.store.count_messages(conv.id)
            messages = self._with_live_text(self.store.messages(conv.id, limit=PAGE))
            await self.chat.show(messages, total, self.turn.id if self.turn else None)
        self._set_title()
        self.refresh_sidebar()
        self.status.context_used = 0
        if self.conv is not None and self.client is not None:
            self._measure_context(self.conv)
        if previous is not None and (self.conv is None or previous.id != self.conv.id):
            self._release(previous.id)
        if self.has_class("-narrow"):
            self.remove_class("-sidebar-open")
        self.prompt.focus()

    def _with_live_text(self, messages: list[StoredMessage]) -> list[StoredMessage]:
        # The answer streaming now is only saved every SAVE_INTERVAL: show what has arrived.
        if self.turn is not None:
            for m in messages:
                if m.id == self.turn.id:
                    m.content, m.reasoning = self.turn.text, self.turn.reasoning
                    if self.turn.thought_s is not None:
                        m.meta = {**m.meta, "thought_s": self.turn.thought_s}
        return messages

    @work(thread=True, group="release", exit_on_error=False)
    def _release(self, conv_id: str) -> None:
        client = self.client
        if client is not None and (self.turn is None or self.turn.conversation_id != conv_id):
            client.release_session(conv_id)

    @work(thread=True, exclusive=True, group="measure", exit_on_error=False)
    def _measure_context(self, conv: Conversation) -> None:
        """Fill the context gauge for a conversation just opened (its whole history, template applied)."""
        count = getattr(self.client, "count_tokens", None)
        if count is None:  # a client that cannot count (remote): the whole history is not worth reading
            return
        history = model_messages(self.store, conv.id)
        if not history:
            return
        used = count(build_request({**conv.settings, "context_policy": ContextPolicy.SHIFT.value}, history, session=None))
        self.app.call_from_thread(self._show_context, conv.id, used)

    def _show_context(self, conv_id: str, used: int) -> None:
        if self.conv is not None and self.conv.id == conv_id and self.turn is None:
            self.status.context_used = used

    @work(thread=True, group="release", exit_on_error=False)
    def _forget(self, conv_id: str) -> None:
        if self.client is not None:
            self.client.forget_session(conv_id)

    @on(ChatView.LoadEarlier)
    async def _load_earlier(self) -> None:
        boxes = self.chat.boxes()
        if self.conv is None or not boxes:
            return
        first = boxes[0].message.id
        older = self.store.messages(self.conv.id, limit=PAGE, before=first)
        remaining = self.store.count_messages(self.conv.id, before=older[0].id) if older else 0
        await self.chat.prepend(older, remaining)

    @on(Sidebar.Picked)
    async def _picked(self, event: Sidebar.Picked) -> None:
        await self.open_conversation(event.conversation_id)
        if event.message_id is not None:
            for box in self.chat.boxes():
                if box.message.id == event.message_id:
                    self.chat.scroll_to_widget(box, animate=False, top=True)
                    box.focus()
                    break

    @on(Sidebar.NewRequested)
    async def _new_requested(self) -> None:
        await self.action_new()

    @on(Sidebar.SearchChanged)
    def _search_changed(self, event: Sidebar.SearchChanged) -> None:
        if event.query.strip():
            self.sidebar.show_hits(self.store.search(event.query))
        else:
            self.refresh_sidebar()

    # -- sending and streaming -------------------------------------------------

    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> None:
        slash = parse_slash(text)
        if slash is not None:
            action, arg = slash
            self.prompt.clear()
            await self.run_action(action.name + "(" + repr(arg) + ")")
            return
        unknown = unknown_slash(text)
        if unknown is not None:
            self.notify(f"Unknown command {unknown}; /help lists them.", severity="warning")
            return
        if self.turn is not None or self._waiting is not None or self._tool_run is not None:
            self.notify("Still answering: wait, or press Esc to stop.", severity="warning")
            return
        files, images = self.attach_bar.attachments, self.attach_bar.images
        refusal = self._image_refusal() if images else None
        if refusal is not None:
            # (the model was switched since the picture was attached) nothing is lost: text and chips stay
            self.notify(refusal, severity="warning", timeout=12)
            return
        content = attachments.compose(text, files)
        if files and not self._attachments_fit(text, content, images):
            return
        if self._editing is not None and self.conv is not None:
            self.store.delete_messages_from(self.conv.id, self._editing)
            self._editing = None
            await self.open_conversation(self.conv.id)
        try:
            if self.conv is None:
                self.conv = self.store.create_conversation(
                    model=self.client.model_name if self.client else self.app.model_ref,
                    settings=dict(self.app.config.chat),
                )
            meta = {}
            if files:
                meta["attachments"] = [{"name": c.attachment.name, "tokens": c.tokens}
                                       for c in self.attach_bar.chips if not c.is_image]
            if images:
                # their names and sizes for the chips; the bytes are the store's (message_images)
                meta["images"] = [{"name": i.name, "bytes": len(i.data)} for i in images]
            untitled = self.conv.title == DEFAULT_TITLE
            user = self.store.add_message(self.conv.id, "user", content, meta=meta or None, images=images)
            if (files or images) and untitled and text.strip():
                # titled from the question, not from the first file's header
                self.store.update_conversation(self.conv.id, title=title_from(text))
        except StoreError as exc:
            # Nothing was sent: the text stays in the input for when there is room.
            self._store_failed(str(exc))
            return
        self.conv = self.store.get_conversation(self.conv.id)
        self.prompt.clear()
        self.attach_bar.clear()
        await self.chat.add(user)
        self._set_title()
        self.refresh_sidebar()
        await self.start_answer(user_id=user.id, prompt=text)

    def _attachments_fit(self, text: str, content: str, images: list[attachments.ImageAttachment]) -> bool:
        """Whether the message with its attachments fits the context (with the system prompt and
        room for the answer); says why not, with the figures. Unknown without a local model."""
        room = getattr(self.client, "prompt_room", None)
        if room is None:
            return True
        settings = self.conv.settings if self.conv is not None else self.app.config.chat
        pictures = [i.part() for i in images]

        def need(body: str) -> tuple[int, int]:
            message = {"role": "user", "content": [*pictures, body] if pictures else body}
            return room(build_request(settings, [message], session=None))

        tokens, limit = need(content)
        if tokens <= limit:
            return True
        bare, _ = need(text if text.strip() else ".")
        room_left = max(limit - bare, 0)
        figures = (f"the attachments take {tokens - bare:,} tokens and this context allows {limit:,} for the whole "
                   f"prompt, so about {room_left:,} tokens of attachments would fit")
        if callable(getattr(self.client, "embed", None)) and text.strip() and room_left > 0:
            question = f"Too large: {figures}. Send only the parts most relevant to your question?"
            self.app.push_screen(ConfirmScreen(question, yes="Send the relevant parts", enter_confirms=True),
                                 lambda yes: yes and self._send_excerpts(text, room_left))
            return False
        self.notify(f"Too large: {figures}; remove some (click a chip, or /detach).", severity="error", timeout=12)
        return False

    @work(thread=True, exclusive=True, group="excerpts", exit_on_error=False)
    def _send_excerpts(self, text: str, room: int) -> None:
        """Send the question with the attachments' parts nearest to it (the loaded model's
        embeddings) in place of the whole files; the chips show what goes."""
        files, count = self.attach_bar.attachments, self._token_counter()
        self.app.call_from_thread(self.notify, "Finding the relevant parts…", timeout=4)
        # the blocks' headers and fences, and the count's rounding, take some of the room
        budget = int(room * 0.9) - 16 * len(files)
        try:
            parts = attachments.excerpts(files, text, budget, count, self.client.embed)
        except EdgechatError as exc:
            self.app.call_from_thread(self.notify, str(exc), severity="error", timeout=12)
            return
        if not parts:
            self.app.call_from_thread(self.notify, "No part of the attachments fits; remove some.", severity="error")
            return

        async def send() -> None:
            images = self.attach_bar.images  # (the pictures go as they are)
            self.attach_bar.clear()
            self.attach_bar.add([*parts, *images], count)
            while not self.attach_bar.counted:
                await asyncio.sleep(0.01)
            await self.send(text)

        self.app.call_from_thread(lambda: self.run_worker(send(), group="excerpts-send"))

    def _token_counter(self):
        """The loaded model's count of a text's tokens (its tokens in a message, less a one-token
        message's), for the chips; None where the client cannot count (remote)."""
        count = getattr(self.client, "count_tokens", None)
        if count is None:
            return None

        def tokens(text: str) -> int:
            one = count(ChatRequest(messages=[{"role": "user", "content": "."}]))
            return count(ChatRequest(messages=[{"role": "user", "content": text}])) - one + 1

        return tokens

    async def start_answer(self, user_id: int | None, prompt: str, tool_step: bool = False) -> None:
        """Answer the conversation; `tool_step`: the next answer after tool calls, not a new question."""
        assert self.conv is not None
        if not tool_step:
            self._tool_steps, self._tools_stopped = 0, False
        try:
            history = model_messages(self.store, self.conv.id)
        except StoreError as exc:  # a picture's file deleted by hand: nothing is sent
            self.notify(str(exc), severity="error", timeout=12)
            self._restore_prompt(prompt)
            return
        model = self.client.model_name if self.client else self.app.model_ref
        try:
            turn = StoredAnswer(self.store, self.conv.id, user_id, prompt, model, on_error=self._store_failed)
        except StoreError as exc:
            self._store_failed(str(exc))
            self._restore_prompt(prompt)
            return
        box = await self.chat.add(turn.message, streaming=True)
        if self.client is None:
            self._waiting = (self.conv, turn)
            self.status.state = "loading; your message will be answered when the model is ready"
            box.loading = True
            return
        self._start(self.conv, turn, history, box)

    def _start(self, conv: Conversation, turn: StoredAnswer, history: list[dict], box: MessageBox) -> None:
        self.turn = turn
        self.status.state = "generating"
        request = build_request(conv.settings, history, session=conv.id)
        if self.client.model_name != conv.model:
            try:
                self.store.update_conversation(conv.id, model=self.client.model_name)
            except StoreError as exc:
                self._store_failed(str(exc))
        self._offered = None
        if conv.settings.get("tools") and self._tool_steps < TOOL_STEPS:
            if self.client.tool_family is not None:
                self._offer_tools(conv, request, box)
                return
            self.notify("Tools run with a local model; answering without them.", severity="warning")
        self.chat.generate(self.client, request, box)

    @work(thread=True, exclusive=True, group="offer-tools", exit_on_error=False)
    def _offer_tools(self, conv: Conversation, request: ChatRequest, box: MessageBox) -> None:
        """Start the enabled tools' servers (off the UI thread: one may take seconds, or hang
        until its timeout), then generate with them offered."""
        choice = conv.settings.get("tool_choice", "auto") if self._tool_steps == 0 else "auto"
        offered, problems = None, []
        try:
            offered = offered_tools(self.app.tool_servers, conv.settings["tools"], choice)
            problems = offered.skipped
            if offered.tools.active:
                request = dataclasses.replace(request, tools=offered.tools, grammar=tool_grammar(offered.tools, self.client.tool_family))
            else:
                offered = None
        except EdgechatError as exc:  # a server that does not start, the SDK missing, a schema the grammar refuses
            offered, problems = None, [str(exc)]
        self.app.call_from_thread(self._generate_offered, offered, problems, request, box)

    def _generate_offered(self, offered, problems: list[str], request: ChatRequest, box: MessageBox) -> None:
        for problem in problems:
            self.notify(f"Tools: {problem}", severity="warning", timeout=10)
        self._offered = offered
        self.chat.generate(self.client, request, box)
        if self._tools_stopped:  # Esc while the servers started
            self.chat.cancel()

    def model_ready(self) -> None:
        """The app loaded a model: show it, and answer a message that was waiting for it."""
        client = self.client
        self.status.model = client.model_name
        self.status.backend = client.backend
        self.status.model_memory = getattr(client, "memory", 0)
        self.status.context_size = client.n_ctx or 0
        self.attach_bar.context_size = client.n_ctx or 0
        self.attach_bar.refresh_summary()
        self.status.state = "ready"
        self._welcome(client.model_name)
        if self.conv is not None:
            self._measure_context(self.conv)
        if client.template_warning:
            self.notify(f"{client.model_name}: {client.template_warning}", severity="warning", timeout=8)
        if self._waiting is not None:
            conv, turn = self._waiting
            self._waiting = None
            history = model_messages(self.store, conv.id)
            box = self._box(turn.id)
            if box is not None:
                box.loading = False
            self._start(conv, turn, history, box or MessageBox(turn.message))

    async def model_failed(self, error: str) -> None:
        self.status.state = "ready" if self.client else "no model"
        self.notify(error, severity="error", timeout=12)
        if self._waiting is not None and self.client is None:
            # Nothing can answer the message that waited for this model: take it back into the input.
            _, turn = self._waiting
            self._waiting = None
            await self._undo_turn(turn)

    def _box(self, message_id: int) -> MessageBox | None:
        for box in self.chat.boxes():
            if box.message.id == message_id:
                return box
        return None

    @on(ChatView.AnswerDelta)
    async def _delta(self, event: ChatView.AnswerDelta) -> None:
        turn = self.turn
        if turn is None:
            return
        turn.append(event.text, reasoning=event.reasoning)
        # The worker's box, unless the user switched away and back (then the view has a new one).
        box = event.box if event.box.is_attached else self._box(turn.id)
        if event.reasoning:
            self.status.state = "thinking…"
            if box is not None:
                box.append_thoughts(event.text)
        elif box is not None:
            await box.append(event.text)

    @on(ChatView.AnswerThoughtsEnded)
    def _thoughts_ended(self, event: ChatView.AnswerThoughtsEnded) -> None:
        turn = self.turn
        if turn is None:
            return
        turn.thought_s = event.seconds
        self.status.state = "generating"
        box = event.box if event.box.is_attached else self._box(turn.id)
        if box is not None:
            box.thoughts_ended(event.seconds, event.tokens)

    @on(ChatView.AnswerEvicted)
    async def _evicted(self, event: ChatView.AnswerEvicted) -> None:
        note = f"Context full: {event.event.note} (still saved in the conversation)."
        self.notify(note, timeout=8)
        box = self._box(self.turn.id) if self.turn else None
        if box is not None:
            await self.chat.add_note("⚠ " + note, before=box)

    @on(ChatView.AnswerMetrics)
    def _metrics(self, event: ChatView.AnswerMetrics) -> None:
        m = event.metrics
        self.status.context_used = m.context_tokens
        self.status.context_size = m.context_size or self.status.context_size
        self.status.ttft = m.ttft
        self.status.tok_s = m.decode_tps
        self.status.spec = 100 * m.accepted_tokens / m.drafted_tokens if m.drafted_tokens else None

    @on(ChatView.AnswerFinished)
    async def _finished(self, event: ChatView.AnswerFinished) -> None:
        turn, self.turn = self.turn, None
        offered, self._offered = self._offered, None
        self.status.state = "ready"
        if turn is None:
            return
        f = event.finished
        calls: list[dict] = []
        if offered is not None and f.reason in ("stop", "length"):
            # the engine took the calls out of the text: what is stored and shown is the answer's words
            calls = [pending_call(c, offered.servers.get(c.name)) for c in f.tool_calls]
        if f.reason == "cancelled" and not f.text.strip() and not (f.reasoning or turn.reasoning).strip():
            # Stopped before anything came back: undo the send, the prompt goes back in the input.
            await self._undo_turn(turn)
            return
        stored = turn.finish(f)
        box = self._box(turn.id)
        if box is not None:
            box.finish(stored)
            await box.replace_text(stored.content)
        if calls:
            self._tool_steps += 1
            self._tool_run = self._run_calls(turn.conversation_id, turn.id, calls)
            self.refresh_sidebar()
            return
        if f.reason == "cancelled":
            self._restore_attachments(turn)
            self._restore_prompt(turn.prompt)
        elif f.reason == "error":
            self.notify(f"The answer failed: {f.error}", severity="error", timeout=10)
        elif f.repeating:
            self.notify("Stopped: the answer was only repeating itself (F4: the loop guard)", timeout=8)
        self.refresh_sidebar()

    @work(exclusive=True, group="tool-calls", exit_on_error=False)
    async def _run_calls(self, conv_id: str, message_id: int, calls: list[dict]) -> None:
        """Each call the answer made: asked about (unless always allowed), run, its outcome stored
        and shown; then the model answers again with what came back. Esc stops it."""
        self.status.state = "tools"
        try:
            for call in calls:
                await self._resolve(conv_id, call)
                self._save_calls(message_id, calls)
                await self._show_calls(message_id, calls)
            if not self._tools_stopped and self.conv is not None and self.conv.id == conv_id:
                # (still this worker's until the answer is under way: nothing else may start between)
                await self.start_answer(user_id=None, prompt="", tool_step=True)
        except asyncio.CancelledError:
            for call in calls:
                if call["outcome"] in ("pending", "running"):
                    call.update(outcome="stopped", result=STOPPED)
            self._save_calls(message_id, calls)
            await self._show_calls(message_id, calls)
            raise
        finally:
            self._tool_run = None
            if self.turn is None:
                self.status.state = "ready"

    async def _resolve(self, conv_id: str, call: dict) -> None:
        qualified = f"{call['server']}.{call['name']}"
        if self._tools_stopped:
            call.update(outcome="stopped", result=STOPPED)
            return
        if not call["server"]:
            call.update(outcome="error", result=f"There is no tool named {call['name']!r}.")
            return
        conv = self.store.get_conversation(conv_id)
        always = list(conv.settings.get("tools_always") or [])
        answer = "yes" if qualified in always else await self.app.push_screen_wait(ToolApprovalScreen(call_line(call)))
        if answer == "always":
            self._update_settings(conv, tools_always=always + [qualified])
        if answer == "stop":
            self._tools_stopped = True
            call.update(outcome="stopped", result=STOPPED)
        elif answer == "no":
            call.update(outcome="denied", result=DENIED)
        else:
            call["outcome"] = "running"
            try:
                text, is_error = await asyncio.to_thread(self.app.tool_servers.call, call["server"], call["name"], json.loads(call["arguments"]))
                call.update(outcome="error" if is_error else "ok", result=text)
            except EdgechatError as exc:  # the server crashed, hung or is gone: one line, and the model is told
                self.notify(str(exc), severity="error", timeout=10)
                call.update(outcome="error", result=str(exc))

    def _save_calls(self, message_id: int, calls: list[dict]) -> None:
        try:
            self.store.update_message(message_id, tool_calls=calls)
        except StoreError as exc:
            self._store_failed(str(exc))

    async def _show_calls(self, message_id: int, calls: list[dict]) -> None:
        box = self._box(message_id)
        if box is not None:
            await box.show_tool_calls([dict(c) for c in calls])

    def _update_settings(self, conv: Conversation, **changes) -> Conversation | None:
        try:
            conv = self.store.update_conversation(conv.id, settings={**conv.settings, **changes})
        except StoreError as exc:
            self._store_failed(str(exc))
            return None
        if self.conv is not None and self.conv.id == conv.id:
            self.conv = conv
        return conv

    @on(ChatView.AnswerFailed)
    async def _failed(self, event: ChatView.AnswerFailed) -> None:
        turn, self.turn = self.turn, None
        self.status.state = "ready"
        if turn is not None:
            await self._undo_turn(turn)
        self.notify(event.error, severity="error", timeout=12)

    async def _undo_turn(self, turn: StoredAnswer) -> None:
        self._restore_attachments(turn)
        first = turn.undo()
        if self.conv is not None and self.conv.id == turn.conversation_id:
            for box in self.chat.boxes():
                if box.message.id >= first:
                    await box.remove()
        self._restore_prompt(turn.prompt)

    def _store_failed(self, error: str) -> None:
        """A write to the conversation store failed (a full disk): say so; what is on screen stays."""
        self.notify(f"Not saved: {error}", severity="error", timeout=12)

    def _restore_attachments(self, turn: StoredAnswer) -> None:
        """A stopped or undone send puts its attachments back above the input, as its text goes back in."""
        user = self.store.get_message(turn.user_id) if turn.user_id is not None else None
        if user is not None and not self.attach_bar.chips:
            self._reattach(user)

    def _reattach(self, message: StoredMessage) -> str:
        """A sent message's files and pictures back as chips; returns the text typed with them."""
        files, text = attachments.split(message.content, len(message.meta.get("attachments") or ()))
        try:
            images = [attachments.ImageAttachment(name, self.store.image_data(stored), stored.media_type or "")
                      for name, stored in zip(image_names(message), message.images, strict=True)]
        except StoreError as exc:
            self.notify(str(exc), severity="error", timeout=12)
            images = []
        if files or images:
            self.attach_bar.add([*files, *images], self._token_counter())
        return text

    def _restore_prompt(self, text: str) -> None:
        if text and not self.prompt.text.strip():
            self.prompt.set_text(text)
            self.prompt.select_all()
        self.prompt.focus()

    def shutdown(self) -> None:
        """Quitting: keep the draft, stop the answer and store what arrived, marked interrupted."""
        self._save_draft()
        if self.turn is not None:
            self.chat.cancel()
            self.turn.interrupt()
            self.turn = None

    # -- actions (keys, palette and slash commands all land here) ----------------

    async def action_new(self, arg: str = "") -> None:
        await self.open_conversation(None)

    def action_stop(self, arg: str = "") -> None:
        if self.turn is not None:
            self._tools_stopped = True
            self.chat.cancel()
        elif self._tool_run is not None:
            self._tools_stopped = True
            self._tool_run.cancel()
        elif self._editing is not None:
            self._editing = None
            self.prompt.clear()
            self.notify("Edit cancelled.")
        elif self.query_one("#search").value:
            self.query_one("#search").value = ""
            self.prompt.focus()

    def _idle(self) -> bool:
        if self.turn is not None or self._waiting is not None or self._tool_run is not None:
            self.notify("Still answering: wait, or press Esc to stop.", severity="warning")
            return False
        return True

    async def action_regenerate(self, arg: str = "") -> None:
        if not self._idle() or self.conv is None:
            return
        messages = self.store.messages(self.conv.id)
        last_user = next((m for m in reversed(messages) if m.role == "user"), None)
        if last_user is None:
            self.notify("Nothing to regenerate yet.")
            return
        after = [m for m in messages if m.id > last_user.id]
        if after:
            self.store.delete_messages_from(self.conv.id, after[0].id)
            for box in self.chat.boxes():
                if box.message.id >= after[0].id:
                    await box.remove()
        await self.start_answer(user_id=None, prompt="")

    async def action_edit_last(self, arg: str = "") -> None:
        if self.conv is None:
            return
        last_user = next((m for m in reversed(self.store.messages(self.conv.id)) if m.role == "user"), None)
        if last_user is not None:
            self.edit_message(last_user)

    def edit_message(self, message: StoredMessage) -> None:
        if not self._idle():
            return
        self._editing = message.id
        text = message.content
        if message.meta.get("attachments") or message.images:
            self.attach_bar.clear()
            text = self._reattach(message)
        self.prompt.set_text(text)
        self.prompt.focus()
        self.notify("Editing: Enter resends from this message (later ones are replaced); Esc cancels.")

    async def action_branch(self, arg: str = "", at: int | None = None) -> None:
        if self.conv is None:
            self.notify("Nothing to branch yet.")
            return
        if at is None:
            focused = self.focused if isinstance(self.focused, MessageBox) else None
            if focused is not None:
                at = focused.message.id
            else:
                messages = self.store.messages(self.conv.id, limit=1)
                if not messages:
                    self.notify("Nothing to branch yet.")
                    return
                at = messages[-1].id
        if self.turn is not None and at >= self.turn.id:
            self.notify("Wait for the answer to finish before branching at it.", severity="warning")
            return
        new = self.store.branch(self.conv.id, at)
        await self.open_conversation(new.id)
        self.notify(f"Branched into “{new.title}”.")

    async def action_rename(self, arg: str = "") -> None:
        if self.conv is None:
            self.notify("Send a message first; new chats are titled from it.")
            return
        if arg:
            await self._rename(arg)
            return
        self.app.push_screen(TextPromptScreen("Rename conversation", self.conv.title), self._rename)

    async def _rename(self, title: str | None) -> None:
        if title and title.strip() and self.conv is not None:
            self.conv = self.store.update_conversation(self.conv.id, title=title.strip())
            self._set_title()
            self.refresh_sidebar()

    async def action_delete(self, arg: str = "") -> None:
        target = self.conv
        if target is None:
            return
        if self.turn is not None and self.turn.conversation_id == target.id:
            self.notify("Stop the answer (Esc) before deleting this conversation.", severity="warning")
            return

        async def confirmed(yes: bool | None) -> None:
            if yes:
                self._deleted = self.store.export_conversation(target.id)
                self.store.delete_conversation(target.id)
                self._forget(target.id)
                await self.open_conversation(None)
                self.notify(f"Deleted “{target.title}”. /undo brings it back.")

        # /undo brings it back: Enter may confirm
        self.app.push_screen(
            ConfirmScreen(f"Delete “{target.title}”?", yes="Delete conversation", enter_confirms=True), confirmed
        )

    async def action_undo(self, arg: str = "") -> None:
        if self._deleted is None:
            self.notify("Nothing to undo.")
            return
        conv = self.store.import_conversation(self._deleted)
        self._deleted = None
        await self.open_conversation(conv.id)
        self.notify(f"Restored “{conv.title}”.")

    def action_search(self, arg: str = "") -> None:
        if self.has_class("-narrow"):
            self.add_class("-sidebar-open")
        self.remove_class("-sidebar-hidden")
        self.sidebar.search(arg)

    def action_settings(self, arg: str = "") -> None:
        settings = dict(self.app.config.chat) if self.conv is None else {**self.app.config.chat, **self.conv.settings}

        def saved(result: dict | None) -> None:
            if result is not None:
                self._save_settings(result)
                self.notify("Settings saved for this conversation.")

        self.app.push_screen(SettingsScreen(settings), saved)

    def _save_settings(self, settings: dict) -> None:
        if self.conv is None:
            self.conv = self.store.create_conversation(
                model=self.client.model_name if self.client else self.app.model_ref, settings=settings
            )
            self.refresh_sidebar()
        else:
            self.conv = self.store.update_conversation(self.conv.id, settings=settings)

    def action_system(self, arg: str = "") -> None:
        if not arg:
            self.action_settings()
            return
        current = dict(self.app.config.chat) if self.conv is None else {**self.app.config.chat, **self.conv.settings}
        self._save_settings(validate_settings({**current, "system_prompt": arg}))
        self.notify("System prompt set for this conversation.")

    def action_tools(self, arg: str = "") -> None:
        words = arg.split()
        if not words:
            self._list_tools(set((self.conv.settings if self.conv else {}).get("tools") or []))
            return
        verb, names = words[0].lower(), words[1:]
        try:
            if verb in CHOICES and not names:
                changes = {"tool_choice": verb}
            elif verb in ("on", "off") and names:
                for name in names:
                    server, _ = split_name(name)
                    if server not in self.app.config.mcp_servers:
                        raise UsageError(f"no MCP server {server!r} in config.toml; add [mcp.servers.{server}]")
                enabled = [t for t in (self.conv.settings.get("tools") or []) if t not in names] if self.conv else []
                changes = {"tools": enabled + (names if verb == "on" else [])}
            else:
                raise UsageError("/tools lists them; /tools on SERVER.TOOL… or off SERVER.TOOL…; /tools required or auto")
        except UsageError as exc:
            self.notify(str(exc), severity="warning")
            return
        if self.conv is None:
            try:
                self.conv = self.store.create_conversation(model=self.client.model_name if self.client else self.app.model_ref,
                                                           settings=dict(self.app.config.chat))
            except StoreError as exc:
                self._store_failed(str(exc))
                return
            self.refresh_sidebar()
        if self._update_settings(self.conv, **changes) is not None:
            enabled = self.conv.settings.get("tools") or []
            choice = self.conv.settings.get("tool_choice", "auto")
            self.notify(f"Tools on in this conversation: {', '.join(enabled) or 'none'} (calls: {choice})")

    @work(thread=True, exclusive=True, group="list-tools", exit_on_error=False)
    def _list_tools(self, enabled: set[str]) -> None:
        """Every configured server's tools (starting them: off the UI thread), as a note."""
        servers = self.app.config.mcp_servers
        if not servers:
            lines = ["No MCP servers: add [mcp.servers.NAME] to config.toml (command, args, env; or a loopback url)."]
        else:
            lines = ["Tools (/tools on SERVER.TOOL to use one here):"]
            for name in servers:
                try:
                    for tool in self.app.tool_servers.tools(name):
                        line = f"[{'on ' if f'{name}.{tool.name}' in enabled else 'off'}] {name}.{tool.name}"
                        lines.append(f"{line}: {tool.description.splitlines()[0]}" if tool.description.strip() else line)
                except EdgechatError as exc:
                    lines.append(f"{name}: {exc}")
        self.app.call_from_thread(self._show_note, "\n".join(lines))

    async def _show_note(self, text: str) -> None:
        await self.chat.add_note(text)
        self.chat.scroll_end(animate=False)

    def action_preset(self, arg: str = "") -> None:
        try:
            presets = load_presets(self.app.paths)
            if arg:
                self._apply_preset(find_preset(presets, arg.strip()).name, presets)
                return
        except UsageError as exc:
            self.notify(str(exc), severity="warning", timeout=10)
            return
        self.app.push_screen(PresetPickerScreen(presets), lambda name: name and self._apply_preset(name, presets))

    def _apply_preset(self, name: str, presets) -> None:
        preset = presets[name]
        current = dict(self.app.config.chat) if self.conv is None else {**self.app.config.chat, **self.conv.settings}
        self._save_settings(preset.apply(current))
        current_model = self.client.model_name if self.client else self.app.model_ref
        if preset.model and preset.model != current_model and self._idle():
            self.app.load_model(preset.model)
        self.notify(f"Preset {name} applied to this conversation.")

    def action_attach(self, arg: str = "") -> None:
        if not arg.strip():
            self.app.push_screen(AttachPickerScreen(Path.cwd()), lambda picked: picked and self.action_attach(picked))
            return
        if (found := self._gather(arg)) is not None:
            self._add_attachments(found)

    def action_image(self, arg: str = "") -> None:
        if not arg.strip():
            self.notify("Name a picture: /image PATH (PNG, JPEG, GIF, BMP)", severity="warning")
            return
        if (found := self._gather(arg)) is None:
            return
        found.skipped += [(a.name, "not an image; /attach sends text files") for a in found.attachments]
        found.attachments = []
        self._add_attachments(found)

    def _gather(self, arg: str) -> attachments.Gathered | None:
        """The files `arg` names (paths, globs, folders); None, said in a notification, when it names none."""
        try:
            return attachments.gather(arg)
        except UsageError as exc:
            self.notify(str(exc), severity="warning")
            return None

    def _image_refusal(self) -> str | None:
        """The loaded model's one line for pictures when it reads none (None: it does, or no
        model is loaded yet: the send checks again)."""
        return self.client.image_refusal if self.client is not None else None

    def _add_attachments(self, found: attachments.Gathered) -> None:
        refusal = self._image_refusal() if found.images else None
        if refusal is not None:
            # a text-only model: the pictures are not attached, said in the engine's one line
            self.notify(refusal, severity="warning", timeout=12)
            found.images = []
            if not found.attachments and not found.skipped:
                self.prompt.focus()
                return
        if found.attachments or found.images:
            self.attach_bar.add([*found.attachments, *found.images], self._token_counter())
        self.notify(found.summary(), severity="warning" if found.skipped else "information")
        self.prompt.focus()

    def action_detach(self, arg: str = "") -> None:
        if not self.attach_bar.chips:
            self.notify("No attachments to remove.")
        elif not arg.strip():
            self.attach_bar.clear()
        elif not self.attach_bar.remove_named(arg.strip()):
            names = ", ".join(c.attachment.name for c in self.attach_bar.chips)
            self.notify(f"No attachment {arg.strip()}; attached: {names}", severity="warning")

    @on(PromptInput.Pasted)
    def _pasted(self, event: PromptInput.Pasted) -> None:
        path = attachments.pasted_path(event.text)
        if path is not None:
            self.action_attach(shlex.quote(str(path)))
        else:
            number = sum(c.attachment.name.startswith("pasted text") for c in self.attach_bar.chips) + 1
            self._add_attachments(attachments.Gathered([attachments.from_paste(event.text, number)]))

    def action_model(self, arg: str = "") -> None:
        if not self._idle():
            return
        if arg:
            self.app.load_model(arg)
            return
        remote = getattr(self.client, "list_models", None)
        current = self.client.model_name if self.client else self.app.model_ref

        def picked(ref: str | None) -> None:
            if ref:
                self.app.load_model(ref)

        try:
            names = remote() if remote else None
        except EdgechatError as exc:
            self.notify(str(exc), severity="error")
            return
        pool = self.app.local_models
        loaded = pool.loaded() if pool is not None and names is None else {}
        self.app.push_screen(ModelPickerScreen(self.app.paths, current, names, loaded), picked)

    def action_export(self, arg: str = "") -> None:
        if self.conv is None:
            self.notify("Nothing to export yet.")
            return
        arg = arg.strip()
        fmt = "json" if arg.lower() == "json" or arg.endswith(".json") else "markdown"
        if arg and arg.lower() not in ("json", "md", "markdown"):
            path = arg
        else:
            slug = re.sub(r"[^a-z0-9]+", "-", self.conv.title.lower()).strip("-")[:40] or "chat"
            path = self.app.paths.data / "exports" / f"{slug}-{self.conv.id}.{'json' if fmt == 'json' else 'md'}"
        try:
            written = export_conversation(self.store, self.conv.id, path, fmt)
        except OSError as exc:
            self.notify(f"Cannot write {path}: {exc.strerror}", severity="error")
            return
        self.notify(f"Exported to {written}", timeout=8)

    def action_clear(self, arg: str = "") -> None:
        if self.conv is None or not self._idle():
            return
        conv = self.conv

        async def confirmed(yes: bool | None) -> None:
            first = self.store.messages(conv.id)
            if yes and first:
                self.store.delete_messages_from(conv.id, first[0].id)
                await self.open_conversation(conv.id)

        self.app.push_screen(ConfirmScreen(f"Remove every message of “{conv.title}”?", yes="Clear"), confirmed)

    def _copy(self, text: str, what: str) -> None:
        self.app.copy_to_clipboard(text)
        # OSC 52 is silently ignored by some terminals: keep a file copy as well.
        fallback = self.app.paths.data / "clipboard.txt"
        try:
            atomic_write_text(fallback, text)
            self.notify(f"Copied {what} (also in {fallback}).")
        except OSError:
            self.notify(f"Copied {what}.")

    def _last_answer(self) -> str | None:
        if self.conv is None:
            return None
        if self.turn is not None and self.turn.conversation_id == self.conv.id:
            return self.turn.text
        answer = next((m for m in reversed(self.store.messages(self.conv.id)) if m.role == "assistant"), None)
        return answer.content if answer else None

    def action_copy(self, arg: str = "") -> None:
        text = self._last_answer()
        if text:
            self._copy(text, "the last answer")
        else:
            self.notify("No answer to copy yet.")

    def action_copy_code(self, arg: str = "") -> None:
        blocks = _CODE_BLOCK.findall(self._last_answer() or "")
        if blocks:
            self._copy(blocks[-1], "the code block")
        else:
            self.notify("The last answer has no code block.")

    def action_toggle_sidebar(self, arg: str = "") -> None:
        if self.has_class("-narrow"):
            self.toggle_class("-sidebar-open")
        else:
            self.toggle_class("-sidebar-hidden")

    @on(Button.Pressed, "#toggle-sidebar")
    @on(Button.Pressed, "#close-sidebar")
    def _toggle_pressed(self) -> None:
        self.action_toggle_sidebar()

    def action_toggle_stats(self, arg: str = "") -> None:
        self.chat.toggle_class("-show-stats")

    def action_toggle_thoughts(self, arg: str = "") -> None:
        """Expand or collapse the thoughts of the focused answer, else of the last answer that has some."""
        focused = self.focused if isinstance(self.focused, MessageBox) else None
        boxes = [focused] if focused is not None else list(reversed(self.chat.boxes()))
        box = next((b for b in boxes if b.thoughts is not None and b.thoughts.text), None)
        if box is None:
            self.notify("No thoughts to show: the answers here came without any.")
            return
        box.thoughts.toggle()

    def action_theme(self, arg: str = "") -> None:
        if arg:
            if arg in self.app.available_themes:
                self.app.theme = arg
            else:
                self.notify(f"Unknown theme {arg}; themes: {', '.join(sorted(self.app.available_themes))}")
            return
        self.app.search_themes()

    def action_help(self, arg: str = "") -> None:
        self.app.push_screen(HelpScreen())

    async def action_quit(self, arg: str = "") -> None:
        await self.app.action_quit()

    @on(MessageBox.Action)
    async def _message_action(self, event: MessageBox.Action) -> None:
        msg = event.box.message
        if event.action == "copy":
            self._copy(event.box.text, "the message")
        elif event.action == "edit":
            if msg.role == "user":
                self.edit_message(msg)
            else:
                self.notify("Only your own messages can be edited; r regenerates an answer.")
        elif event.action == "branch":
            await self.action_branch(at=msg.id)
        elif event.action == "regenerate":
            await self.action_regenerate()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "generate" and event.state == WorkerState.ERROR:
            # A bug in the stream (not a user error): keep what arrived, say so.
            turn, self.turn = self.turn, None
            if turn is not None:
                turn.fail(str(event.worker.error))
            self.status.state = "ready"
            self.notify(f"Generation failed: {event.worker.error}", severity="error")
