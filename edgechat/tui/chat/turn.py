"""A chat turn: the message sent (or a slash command run), the answer streamed into its box and
stored as it arrives, its end (tool calls handed on, a stop, an error), and going back on it:
Esc, undo of an answer that never came, regenerate, edit."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from textual.message import Message
from textual.widgets import Input
from textual.worker import Worker, WorkerState

from edgechat import attachments
from edgechat.errors import StoreError
from edgechat.store import DEFAULT_TITLE, Conversation, title_from
from edgechat.store import Message as StoredMessage
from edgechat.store.answer import StoredAnswer
from edgechat.store.history import model_messages
from edgechat.tui.actions import parse_slash, unknown_slash
from edgechat.tui.chat.attachments import AttachmentsPart
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.chat.gauge import GaugePart
from edgechat.tui.chat.tools import ToolsPart
from edgechat.tui.config import build_request
from edgechat.tui.toolrun import pending_call
from edgechat.tui.widgets.chatview import ChatView, MessageBox


class TurnPart:
    def __init__(self, screen: ChatBase, attachments: AttachmentsPart, tools: ToolsPart, gauge: GaugePart,
                 open_conversation: Callable[[str | None], Awaitable[None]]) -> None:
        self.screen = screen
        self.attachments = attachments
        self.tools = tools
        self.gauge = gauge
        #: the screen's own: shows a conversation again after an edit removed its end
        self._open_conversation = open_conversation
        #: an answer waiting for the model to finish loading
        self.waiting: tuple[Conversation, StoredAnswer] | None = None
        #: the user message being edited (Enter resends from there)
        self.editing: int | None = None

    def idle(self) -> bool:
        """Whether nothing is being answered (else says so): no answer streaming, waiting for the
        model, or running its tool calls."""
        if self.screen.turn is not None or self.waiting is not None or self.tools.running is not None:
            self.screen.notify("Still answering: wait, or press Esc to stop.", severity="warning")
            return False
        return True

    def with_live_text(self, messages: list[StoredMessage]) -> list[StoredMessage]:
        # The answer streaming now is only saved every SAVE_INTERVAL: show what has arrived.
        if self.screen.turn is not None:
            for m in messages:
                if m.id == self.screen.turn.id:
                    m.content, m.reasoning = self.screen.turn.text, self.screen.turn.reasoning
                    if self.screen.turn.thought_s is not None:
                        m.meta = {**m.meta, "thought_s": self.screen.turn.thought_s}
        return messages

    async def send(self, text: str) -> None:
        slash = parse_slash(text)
        if slash is not None:
            action, arg = slash
            self.screen.prompt.clear()
            await self.screen.run_action(action.name + "(" + repr(arg) + ")")
            return
        unknown = unknown_slash(text)
        if unknown is not None:
            self.screen.notify(f"Unknown command {unknown}; /help lists them.", severity="warning")
            return
        if not self.idle():
            return
        files, images = self.screen.attach_bar.attachments, self.screen.attach_bar.images
        refusal = self.attachments.image_refusal() if images else None
        if refusal is not None:
            # (the model was switched since the picture was attached) nothing is lost: text and chips stay
            self.screen.notify(refusal, severity="warning", timeout=12)
            return
        content = attachments.compose(text, files)
        if files and not self.attachments.fit(text, content, images, self.send):
            return
        if self.editing is not None and self.screen.conv is not None:
            self.screen.store.delete_messages_from(self.screen.conv.id, self.editing)
            self.editing = None
            await self._open_conversation(self.screen.conv.id)
        try:
            if self.screen.conv is None:
                self.screen.conv = self.screen.store.create_conversation(
                    model=self.screen.client.model_name if self.screen.client else self.screen.app.model_ref,
                    settings=dict(self.screen.app.config.chat),
                )
            meta = {}
            if files:
                meta["attachments"] = [{"name": c.attachment.name, "tokens": c.tokens}
                                       for c in self.screen.attach_bar.chips if not c.is_image]
            if images:
                # their names and sizes for the chips; the bytes are the store's (message_images)
                meta["images"] = [{"name": i.name, "bytes": len(i.data)} for i in images]
            untitled = self.screen.conv.title == DEFAULT_TITLE
            user = self.screen.store.add_message(self.screen.conv.id, "user", content, meta=meta or None, images=images)
            if (files or images) and untitled and text.strip():
                # titled from the question, not from the first file's header
                self.screen.store.update_conversation(self.screen.conv.id, title=title_from(text))
        except StoreError as exc:
            # Nothing was sent: the text stays in the input for when there is room.
            self.screen.store_failed(str(exc))
            return
        self.screen.conv = self.screen.store.get_conversation(self.screen.conv.id)
        self.screen.prompt.clear()
        self.screen.attach_bar.clear()
        await self.screen.chat.add(user)
        self.screen.set_title()
        self.screen.refresh_sidebar()
        await self.start_answer(user_id=user.id, prompt=text)

    async def start_answer(self, user_id: int | None, prompt: str, tool_step: bool = False) -> None:
        """Answer the conversation; `tool_step`: the next answer after tool calls, not a new question."""
        assert self.screen.conv is not None
        if not tool_step:
            self.tools.new_question()
        try:
            history = model_messages(self.screen.store, self.screen.conv.id)
        except StoreError as exc:  # a picture's file deleted by hand: nothing is sent
            self.screen.notify(str(exc), severity="error", timeout=12)
            self._restore_prompt(prompt)
            return
        model = self.screen.client.model_name if self.screen.client else self.screen.app.model_ref
        try:
            turn = StoredAnswer(self.screen.store, self.screen.conv.id, user_id, prompt, model, on_error=self.screen.store_failed)
        except StoreError as exc:
            self.screen.store_failed(str(exc))
            self._restore_prompt(prompt)
            return
        box = await self.screen.chat.add(turn.message, streaming=True)
        if self.screen.client is None:
            self.waiting = (self.screen.conv, turn)
            self.screen.status.state = "loading; your message will be answered when the model is ready"
            box.loading = True
            return
        self._start(self.screen.conv, turn, history, box)

    def _start(self, conv: Conversation, turn: StoredAnswer, history: list[dict], box: MessageBox) -> None:
        self.screen.turn = turn
        self.screen.status.state = "generating"
        request = build_request(conv.settings, history, session=conv.id)
        if self.screen.client.model_name != conv.model:
            try:
                self.screen.store.update_conversation(conv.id, model=self.screen.client.model_name)
            except StoreError as exc:
                self.screen.store_failed(str(exc))
        self.tools.offered = None
        if self.tools.wanted(conv):
            if self.screen.client.tool_family is not None:
                self.tools.offer(conv, request, box)
                return
            self.screen.notify("Tools run with a local model; answering without them.", severity="warning")
        self.screen.chat.generate(self.screen.client, request, box)

    def answer_waiting(self) -> None:
        """A model is loaded: answer the message that was waiting for it, if one was."""
        if self.waiting is not None:
            conv, turn = self.waiting
            self.waiting = None
            history = model_messages(self.screen.store, conv.id)
            box = self.screen.box(turn.id)
            if box is not None:
                box.loading = False
            self._start(conv, turn, history, box or MessageBox(turn.message))

    async def give_back_waiting(self) -> None:
        """The model failed to load: with none to answer it, the waiting message goes back into the input."""
        if self.waiting is not None and self.screen.client is None:
            _, turn = self.waiting
            self.waiting = None
            await self._undo_turn(turn)

    async def answer_event(self, event: Message) -> None:
        """One of the chat view's messages about the answer streaming (the screen hands them on)."""
        match event:
            case ChatView.AnswerDelta():
                await self._delta(event)
            case ChatView.AnswerThoughtsEnded():
                self._thoughts_ended(event)
            case ChatView.AnswerEvicted():
                await self._evicted(event)
            case ChatView.AnswerFinished():
                await self._finished(event)
            case ChatView.AnswerFailed():
                await self._failed(event)

    async def _delta(self, event: ChatView.AnswerDelta) -> None:
        turn = self.screen.turn
        if turn is None:
            return
        turn.append(event.text, reasoning=event.reasoning)
        # The worker's box, unless the user switched away and back (then the view has a new one).
        box = event.box if event.box.is_attached else self.screen.box(turn.id)
        if event.reasoning:
            self.screen.status.state = "thinking…"
            if box is not None:
                box.append_thoughts(event.text)
        else:
            self.screen.voice.feed(event.text)
            if box is not None:
                await box.append(event.text)

    def _thoughts_ended(self, event: ChatView.AnswerThoughtsEnded) -> None:
        turn = self.screen.turn
        if turn is None:
            return
        turn.thought_s = event.seconds
        self.screen.status.state = "generating"
        box = event.box if event.box.is_attached else self.screen.box(turn.id)
        if box is not None:
            box.thoughts_ended(event.seconds, event.tokens)

    async def _evicted(self, event: ChatView.AnswerEvicted) -> None:
        note = f"Context full: {event.event.note} (still saved in the conversation)."
        self.screen.notify(note, timeout=8)
        box = self.screen.box(self.screen.turn.id) if self.screen.turn else None
        if box is not None:
            await self.screen.chat.add_note("⚠ " + note, before=box)

    async def _finished(self, event: ChatView.AnswerFinished) -> None:
        f = event.finished
        turn = self.screen.turn
        offered, self.tools.offered = self.tools.offered, None
        self.screen.status.state = "ready"
        if turn is None:
            return
        calls: list[dict] = []
        if offered is not None and f.reason in ("stop", "length"):
            # the engine took the calls out of the text: what is stored and shown is the answer's words
            calls = [pending_call(c, offered.servers.get(c.name)) for c in f.tool_calls]
        if not calls:
            self.screen.turn = None
        if f.reason != "cancelled":
            self.screen.voice.finish()
        if f.reason == "cancelled" and not f.text.strip() and not (f.reasoning or turn.reasoning).strip():
            # Stopped before anything came back: undo the send, the prompt goes back in the input.
            await self._undo_turn(turn)
            return
        stored = turn.finish(f)
        box = self.screen.box(turn.id)
        if box is not None:
            box.finish(stored)
            await box.replace_text(stored.content)
        if calls:
            # the turn is handed to its calls with no await between: never idle in between
            self.screen.turn = None
            self.tools.run_calls(turn.conversation_id, turn.id, calls, self._answer_calls)
            self.screen.refresh_sidebar()
            return
        if f.reason == "cancelled":
            self.attachments.restore(turn)
            self._restore_prompt(turn.prompt)
        elif f.reason == "error":
            self.screen.notify(f"The answer failed: {f.error}", severity="error", timeout=10)
        elif f.repeating:
            self.screen.notify("Stopped: the answer was only repeating itself (F4: the loop guard)", timeout=8)
        self.screen.refresh_sidebar()

    async def _failed(self, event: ChatView.AnswerFailed) -> None:
        turn, self.screen.turn = self.screen.turn, None
        self.screen.status.state = "ready"
        if turn is not None:
            await self._undo_turn(turn)
        self.screen.notify(event.error, severity="error", timeout=12)

    async def _answer_calls(self) -> None:
        """The model answers again with what its tool calls gave back."""
        await self.start_answer(user_id=None, prompt="", tool_step=True)

    async def _undo_turn(self, turn: StoredAnswer) -> None:
        self.attachments.restore(turn)
        first = turn.undo()
        if self.screen.conv is not None and self.screen.conv.id == turn.conversation_id:
            for box in self.screen.chat.boxes():
                if box.message.id >= first:
                    await box.remove()
        self._restore_prompt(turn.prompt)

    def _restore_prompt(self, text: str) -> None:
        if text and not self.screen.prompt.text.strip():
            self.screen.prompt.set_text(text)
            self.screen.prompt.select_all()
        self.screen.prompt.focus()

    def shutdown(self) -> None:
        """Quitting: stop the answer and store what arrived, marked interrupted."""
        if self.screen.turn is not None:
            self.screen.chat.cancel()
            self.screen.turn.interrupt()
            self.screen.turn = None

    def stop(self, arg: str = "") -> None:
        """Esc: silence the voice, stop the answer or its tool calls, else the edit, else the search."""
        self.screen.voice.stop()
        if self.screen.turn is not None:
            self.tools.stopped = True
            self.screen.chat.cancel()
        elif self.tools.stop():
            pass
        elif self.editing is not None:
            self.editing = None
            self.screen.prompt.clear()
            self.screen.notify("Edit cancelled.")
        elif self.screen.query_one("#search", Input).value:
            self.screen.query_one("#search", Input).value = ""
            self.screen.prompt.focus()

    async def regenerate(self, arg: str = "") -> None:
        if not self.idle() or self.screen.conv is None:
            return
        messages = self.screen.store.messages(self.screen.conv.id)
        last_user = next((m for m in reversed(messages) if m.role == "user"), None)
        if last_user is None:
            self.screen.notify("Nothing to regenerate yet.")
            return
        after = [m for m in messages if m.id > last_user.id]
        if after:
            self.screen.store.delete_messages_from(self.screen.conv.id, after[0].id)
            for box in self.screen.chat.boxes():
                if box.message.id >= after[0].id:
                    await box.remove()
        await self.start_answer(user_id=None, prompt="")

    async def edit_last(self, arg: str = "") -> None:
        if self.screen.conv is None:
            return
        last_user = next((m for m in reversed(self.screen.store.messages(self.screen.conv.id)) if m.role == "user"), None)
        if last_user is not None:
            self.edit_message(last_user)

    def edit_message(self, message: StoredMessage) -> None:
        if not self.idle():
            return
        self.editing = message.id
        text = message.content
        if message.meta.get("attachments") or message.images:
            self.screen.attach_bar.clear()
            text = self.attachments.reattach(message)
        self.screen.prompt.set_text(text)
        self.screen.prompt.focus()
        self.screen.notify("Editing: Enter resends from this message (later ones are replaced); Esc cancels.")

    def worker_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "generate" and event.state == WorkerState.ERROR:
            # A bug in the stream (not a user error): keep what arrived, say so.
            turn, self.screen.turn = self.screen.turn, None
            if turn is not None:
                turn.fail(str(event.worker.error))
            self.screen.status.state = "ready"
            self.screen.notify(f"Generation failed: {event.worker.error}", severity="error")
