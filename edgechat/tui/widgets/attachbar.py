"""The files going with the next message, as chips above the input: each one's name and tokens
(a picture's: its size), and what they take of the context. A click on a chip (its ✕) takes it off."""

from __future__ import annotations

from collections.abc import Callable

from textual import work
from textual.containers import VerticalScroll
from textual.widgets import Static

from edgechat.attachments import Attachment, ImageAttachment


class Chip(Static):
    def __init__(self, attachment: Attachment | ImageAttachment):
        super().__init__("", classes="chip", markup=False)
        self.attachment = attachment
        #: tokens as the loaded model counts them (None until counted)
        self.tokens: int | None = None
        #: counted by a length estimate (no tokenizer here: a remote server)
        self.estimated = False

    @property
    def is_image(self) -> bool:
        return isinstance(self.attachment, ImageAttachment)

    def label(self) -> str:
        if isinstance(self.attachment, ImageAttachment):
            size = f"{self.attachment.size} image"
        elif self.tokens is None:
            size = "counting…"
        else:
            size = f"{'~' if self.estimated else ''}{self.tokens:,} tokens"
        # size first: a long name is cut at the right edge, not the figure
        return f"✕ {size} · {self.attachment.name}"

    def on_mount(self) -> None:
        self.update(self.label())

    def on_click(self) -> None:
        bar = self.parent
        self.remove()
        if isinstance(bar, AttachBar):
            bar.call_after_refresh(bar.refresh_summary)


class AttachBar(VerticalScroll):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        #: the context's size in tokens, for the share the chips take (0: unknown)
        self.context_size = 0
        self.add_class("-empty")

    def compose(self):
        yield Static("", id="attach-summary", markup=False)

    @property
    def chips(self) -> list[Chip]:
        return list(self.query(Chip))

    @property
    def attachments(self) -> list[Attachment]:
        """The text files (their blocks go into the message's text)."""
        return [c.attachment for c in self.chips if isinstance(c.attachment, Attachment)]

    @property
    def images(self) -> list[ImageAttachment]:
        return [c.attachment for c in self.chips if isinstance(c.attachment, ImageAttachment)]

    @property
    def tokens(self) -> int:
        return sum(c.tokens or 0 for c in self.chips)

    @property
    def counted(self) -> bool:
        return all(c.tokens is not None for c in self.chips if not c.is_image)

    def add(self, attachments: list[Attachment | ImageAttachment], count: Callable[[str], int] | None) -> None:
        """Show them and count the text files' tokens in a thread (`count`: the model's count of
        a text; None: a length estimate)."""
        chips = [Chip(a) for a in attachments]
        self.mount_all(chips, before="#attach-summary")
        self._count([(c, c.attachment) for c in chips if isinstance(c.attachment, Attachment)], count)
        self.refresh_summary()

    def remove_named(self, name: str) -> bool:
        chips = [c for c in self.chips if c.attachment.name == name]
        for chip in chips:
            chip.remove()
        self.call_after_refresh(self.refresh_summary)
        return bool(chips)

    def clear(self) -> None:
        for chip in self.chips:
            chip.remove()
        self.call_after_refresh(self.refresh_summary)

    @work(thread=True, group="count-attachments", exit_on_error=False)
    def _count(self, files: list[tuple[Chip, Attachment]], count: Callable[[str], int] | None) -> None:
        for chip, attachment in files:
            text = attachment.block()
            # ~4 characters a token: what English and code average in common tokenizers
            tokens = count(text) if count is not None else len(text) // 4
            self.app.call_from_thread(self._counted, chip, tokens, count is None)

    def _counted(self, chip: Chip, tokens: int, estimated: bool) -> None:
        chip.tokens, chip.estimated = tokens, estimated
        chip.update(chip.label())
        self.refresh_summary()

    def refresh_summary(self) -> None:
        chips = self.chips
        self.set_class(not chips, "-empty")
        if not chips:
            return
        n_images = sum(c.is_image for c in chips)
        n_files = len(chips) - n_images
        files = ", ".join(f"{n} {word}{'s' if n != 1 else ''}" for n, word in ((n_files, "file"), (n_images, "image")) if n)
        if not self.counted:
            text = f"{files}, counting tokens…"
        elif not n_files:
            text = files
        else:
            share = f", {100 * self.tokens / self.context_size:.0f}% of {self.context_size:,} context tokens" \
                if self.context_size else ""
            text = f"{files}, {self.tokens:,} tokens{share}"
        self.query_one("#attach-summary", Static).update(text)
