"""Attachments: files and pictures above the input (`/attach`, `/image`, `/detach`, a pasted path
or text), whether they fit the context (else their parts nearest to the question), and putting
them back when a send is stopped, undone or edited."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

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


class AttachmentsPart:
    def __init__(self, screen: ChatBase) -> None:
        self.screen = screen

    def fit(self, text: str, content: str, images: list[attachments.ImageAttachment],
            send: Callable[[str], Awaitable[None]]) -> bool:
        """Whether the message with its attachments fits the context (with the system prompt and
        room for the answer); says why not, with the figures. Unknown without a local model.
        Where the parts nearest the question would fit, offers to `send` the question with those."""
        room = getattr(self.screen.client, "prompt_room", None)
        if room is None:
            return True
        settings = self.screen.conv.settings if self.screen.conv is not None else self.screen.app.config.chat
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
        if callable(getattr(self.screen.client, "embed", None)) and text.strip() and room_left > 0:
            question = f"Too large: {figures}. Send only the parts most relevant to your question?"

            def answered(yes: bool | None) -> None:
                if yes:
                    self.screen.run_worker(partial(self._send_excerpts, text, room_left, send), group="excerpts",
                                           thread=True, exclusive=True, exit_on_error=False)

            self.screen.app.push_screen(ConfirmScreen(question, yes="Send the relevant parts", enter_confirms=True), answered)
            return False
        self.screen.notify(f"Too large: {figures}; remove some (click a chip, or /detach).", severity="error", timeout=12)
        return False

    def _send_excerpts(self, text: str, room: int, send: Callable[[str], Awaitable[None]]) -> None:
        """Send the question with the attachments' parts nearest to it (the loaded model's
        embeddings) in place of the whole files; the chips show what goes."""
        files, count = self.screen.attach_bar.attachments, self._token_counter()
        self.screen.app.call_from_thread(self.screen.notify, "Finding the relevant parts…", timeout=4)
        # the blocks' headers and fences, and the count's rounding, take some of the room
        budget = int(room * 0.9) - 16 * len(files)
        try:
            parts = attachments.excerpts(files, text, budget, count, self.screen.client.embed)
        except EdgechatError as exc:
            self.screen.app.call_from_thread(self.screen.notify, str(exc), severity="error", timeout=12)
            return
        if not parts:
            self.screen.app.call_from_thread(self.screen.notify, "No part of the attachments fits; remove some.", severity="error")
            return

        async def send_parts() -> None:
            images = self.screen.attach_bar.images  # (the pictures go as they are)
            self.screen.attach_bar.clear()
            self.screen.attach_bar.add([*parts, *images], count)
            while not self.screen.attach_bar.counted:
                await asyncio.sleep(0.01)
            await send(text)

        self.screen.app.call_from_thread(lambda: self.screen.run_worker(send_parts(), group="excerpts-send"))

    def _token_counter(self):
        """The loaded model's count of a text's tokens (its tokens in a message, less a one-token
        message's), for the chips; None where the client cannot count (remote)."""
        count = getattr(self.screen.client, "count_tokens", None)
        if count is None:
            return None

        def tokens(text: str) -> int:
            one = count(ChatRequest(messages=[{"role": "user", "content": "."}]))
            return count(ChatRequest(messages=[{"role": "user", "content": text}])) - one + 1

        return tokens

    def restore(self, turn: StoredAnswer) -> None:
        """A stopped or undone send puts its attachments back above the input, as its text goes back in."""
        user = self.screen.store.get_message(turn.user_id) if turn.user_id is not None else None
        if user is not None and not self.screen.attach_bar.chips:
            self.reattach(user)

    def reattach(self, message: StoredMessage) -> str:
        """A sent message's files and pictures back as chips; returns the text typed with them."""
        files, text = attachments.split(message.content, len(message.meta.get("attachments") or ()))
        try:
            images = [attachments.ImageAttachment(name, self.screen.store.image_data(stored), stored.media_type or "")
                      for name, stored in zip(image_names(message), message.images, strict=True)]
        except StoreError as exc:
            self.screen.notify(str(exc), severity="error", timeout=12)
            images = []
        if files or images:
            self.screen.attach_bar.add([*files, *images], self._token_counter())
        return text

    def attach(self, arg: str = "") -> None:
        if not arg.strip():

            def picked(paths: str | None) -> None:
                if paths:
                    self.attach(paths)

            self.screen.app.push_screen(AttachPickerScreen(Path.cwd()), picked)
            return
        if attachments.names_audio(arg):
            self.screen.notify("Writing down what is said…")
            self.screen.run_worker(partial(self._gather_audio, arg), group="attach-audio", thread=True)
        elif (found := self._gather(arg)) is not None:
            self._add_attachments(found)

    def _gather_audio(self, arg: str) -> None:
        """`_gather` off the event loop: a minute of speech takes seconds to write down."""
        try:
            found = attachments.gather(arg)
        except UsageError as exc:
            self.screen.app.call_from_thread(self.screen.notify, str(exc), severity="warning")
            return
        self.screen.app.call_from_thread(self._add_attachments, found)

    def image(self, arg: str = "") -> None:
        if not arg.strip():
            self.screen.notify("Name a picture: /image PATH (PNG, JPEG, GIF, BMP)", severity="warning")
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
            self.screen.notify(str(exc), severity="warning")
            return None

    def image_refusal(self) -> str | None:
        """The loaded model's one line for pictures when it reads none (None: it does, or no
        model is loaded yet: the send checks again)."""
        return self.screen.client.image_refusal if self.screen.client is not None else None

    def _add_attachments(self, found: attachments.Gathered) -> None:
        refusal = self.image_refusal() if found.images else None
        if refusal is not None:
            # a text-only model: the pictures are not attached, said in the engine's one line
            self.screen.notify(refusal, severity="warning", timeout=12)
            found.images = []
            if not found.attachments and not found.skipped:
                self.screen.prompt.focus()
                return
        if found.attachments or found.images:
            self.screen.attach_bar.add([*found.attachments, *found.images], self._token_counter())
        self.screen.notify(found.summary(), severity="warning" if found.skipped else "information")
        self.screen.prompt.focus()

    def detach(self, arg: str = "") -> None:
        if not self.screen.attach_bar.chips:
            self.screen.notify("No attachments to remove.")
        elif not arg.strip():
            self.screen.attach_bar.clear()
        elif not self.screen.attach_bar.remove_named(arg.strip()):
            names = ", ".join(c.attachment.name for c in self.screen.attach_bar.chips)
            self.screen.notify(f"No attachment {arg.strip()}; attached: {names}", severity="warning")

    def pasted(self, text: str) -> None:
        """Text pasted into the input: a file's path attaches the file, other text attaches as it is."""
        path = attachments.pasted_path(text)
        if path is not None:
            self.attach(shlex.quote(str(path)))
        else:
            number = sum(c.attachment.name.startswith("pasted text") for c in self.screen.attach_bar.chips) + 1
            self._add_attachments(attachments.Gathered([attachments.from_paste(text, number)]))
