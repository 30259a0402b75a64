"""A chat turn: the message sent (or a slash command run), the answer streamed into its box and
stored as it arrives, its end (tool calls handed on, a stop, an error), and going back on it:
Esc, undo of an answer that never came, regenerate, edit."""

from __future__ import annotations

from textual import on
from textual.widgets import Input
from textual.worker import Worker, WorkerState

from edgechat import attachments
from edgechat.errors import StoreError
from edgechat.store import DEFAULT_TITLE, Conversation, title_from
from edgechat.store import Message as StoredMessage
from edgechat.store.answer import StoredAnswer
from edgechat.store.history import model_messages
from edgechat.tui.actions import parse_slash, unknown_slash
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.config import build_request
from edgechat.tui.toolrun import TOOL_STEPS, pending_call
from edgechat.tui.widgets.chatview import ChatView, MessageBox
from edgechat.tui.widgets.prompt import PromptInput


class TurnPart(ChatBase):
    def _with_live_text(self, messages: list[StoredMessage]) -> list[StoredMessage]:
        # The answer streaming now is only saved every SAVE_INTERVAL: show what has arrived.
        if self.turn is not None:
            for m in messages:
                if m.id == self.turn.id:
                    m.content, m.reasoning = self.turn.text, self.turn.reasoning
                    if self.turn.thought_s is not None:
                        m.meta = {**m.meta, "thought_s": self.turn.thought_s}
        return messages

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
        if not self._idle():
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
        else:
            self.voice.feed(event.text)
            if box is not None:
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

    @on(ChatView.AnswerFinished)
    async def _finished(self, event: ChatView.AnswerFinished) -> None:
        f = event.finished
        turn = self.turn
        offered, self._offered = self._offered, None
        self.status.state = "ready"
        if turn is None:
            return
        calls: list[dict] = []
        if offered is not None and f.reason in ("stop", "length"):
            # the engine took the calls out of the text: what is stored and shown is the answer's words
            calls = [pending_call(c, offered.servers.get(c.name)) for c in f.tool_calls]
        if not calls:
            self.turn = None
        if f.reason != "cancelled":
            self.voice.finish()
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
            # the turn is handed to its calls with no await between: never idle in between
            self._tool_steps += 1
            self.turn = None
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

    def action_stop(self, arg: str = "") -> None:
        self.voice.stop()
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
        elif self.query_one("#search", Input).value:
            self.query_one("#search", Input).value = ""
            self.prompt.focus()

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

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "generate" and event.state == WorkerState.ERROR:
            # A bug in the stream (not a user error): keep what arrived, say so.
            turn, self.turn = self.turn, None
            if turn is not None:
                turn.fail(str(event.worker.error))
            self.status.state = "ready"
            self.notify(f"Generation failed: {event.worker.error}", severity="error")
