"""Attachments: files and pictures above the input (`/attach`, `/image`, `/detach`, a pasted path
or text), whether they fit the context (else their parts nearest to the question), and putting
them back when a send is stopped, undone or edited."""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path

from textual import on, work

from edgechat import attachments
from edgechat.engine.types.request import ChatRequest
from edgechat.errors import EdgechatError, StoreError, UsageError
from edgechat.store import Message as StoredMessage
from edgechat.store import image_names
from edgechat.store.answer import StoredAnswer
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.config import build_request
from edgechat.tui.screens.dialogs import ConfirmScreen
from edgechat.tui.screens.pickers import AttachPickerScreen
from edgechat.tui.widgets.prompt import PromptInput


class AttachmentsPart(ChatBase):
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

            def answered(yes: bool | None) -> None:
                if yes:
                    self._send_excerpts(text, room_left)

            self.app.push_screen(ConfirmScreen(question, yes="Send the relevant parts", enter_confirms=True), answered)
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

    def action_attach(self, arg: str = "") -> None:
        if not arg.strip():

            def picked(paths: str | None) -> None:
                if paths:
                    self.action_attach(paths)

            self.app.push_screen(AttachPickerScreen(Path.cwd()), picked)
            return
        if attachments.names_audio(arg):
            self.notify("Writing down what is said…")
            self._gather_audio(arg)
        elif (found := self._gather(arg)) is not None:
            self._add_attachments(found)

    @work(thread=True, group="attach-audio")
    def _gather_audio(self, arg: str) -> None:
        """`_gather` off the event loop: a minute of speech takes seconds to write down."""
        try:
            found = attachments.gather(arg)
        except UsageError as exc:
            self.app.call_from_thread(self.notify, str(exc), severity="warning")
            return
        self.app.call_from_thread(self._add_attachments, found)

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
