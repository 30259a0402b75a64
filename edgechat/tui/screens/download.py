"""Offer a catalog model that is not on disk, as LM Studio does: its size, licence and whether it
fits here, then the download with progress and a Cancel that stops it."""

from __future__ import annotations

from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Label, ProgressBar
from textual.worker import Worker, WorkerState, get_current_worker

from edgechat.config import Paths
from edgechat.errors import EdgechatError
from edgechat.models import hub, planner
from edgechat.models.catalog import CatalogEntry, CatalogFile, format_size


class _Cancelled(Exception):
    """Raised from the progress callback to stop hf_hub_download between two chunks."""


class DownloadScreen(ModalScreen[bool]):
    """True once the model is on disk (the picker then loads it); False when cancelled or closed."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    class Checked(Message):
        """The Hub was asked whether it can be reached: `why` it cannot, or None."""

        def __init__(self, why: str | None):
            super().__init__()
            self.why = why

    class Progress(Message):
        def __init__(self, done: int, total: int | None):
            super().__init__()
            self.done = done
            self.total = total

    def __init__(self, entry: CatalogEntry, cfile: CatalogFile, paths: Paths):
        super().__init__(classes="dialog-screen")
        self.entry = entry
        self.cfile = cfile
        self.paths = paths
        self.ref = entry.name if cfile is entry.default else f"{entry.name}:{cfile.quant}"
        #: a vision model's projector comes with it (as `edgechat pull` brings it), counted in the fit
        self.download_size = cfile.size + (entry.mmproj.size if entry.mmproj else 0)
        self.fits = planner.weights_fit(self.download_size)
        self._download_worker: Worker | None = None

    def compose(self):
        free = format_size(planner.available_memory() * planner.headroom())
        fit = f"fits this machine ({free} free)" if self.fits else f"will not fit in the memory free here ({free})"
        with Vertical(classes="dialog download-dialog"):
            yield Label(f"Download {self.ref}?", classes="dialog-title", markup=False)
            projector = f" + vision projector {format_size(self.entry.mmproj.size)}" if self.entry.mmproj else ""
            yield Label(f"{format_size(self.cfile.size)}{projector} · {self.cfile.quant} · licence {self.entry.licence} · "
                        f"from {self.entry.repo}", id="download-about", markup=False)
            yield Label(fit, id="download-fit", classes="fits" if self.fits else "no-fit", markup=False)
            yield Label("asking the Hub…", id="download-status", markup=False)
            yield ProgressBar(total=self.download_size, show_eta=False, id="download-progress")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"Download {format_size(self.download_size)}", id="download", variant="primary",
                             compact=True, disabled=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()
        self._check()

    # the probe takes up to a few seconds when the network is down: never on the UI thread
    @work(thread=True, exit_on_error=False)
    def _check(self) -> None:
        try:
            hub.check_reachable(self.ref)
        except hub.HubUnreachableError as exc:
            self.post_message(self.Checked(exc.why))
            return
        self.post_message(self.Checked(None))

    @on(Checked)
    def _checked(self, event: Checked) -> None:
        status = self.query_one("#download-status", Label)
        button = self.query_one("#download", Button)
        if event.why is not None:
            todo = "unset it" if hub.offline() else "connect to the internet"
            status.update(f"Cannot download: {event.why}; {todo} and pick it again.")
            button.display = False
            return
        status.display = False  # nothing to say until the download starts
        button.disabled = False
        if self.fits:  # Enter downloads; one that will not fit takes a deliberate click or Tab
            button.focus()

    @on(Button.Pressed, "#download")
    def _start(self) -> None:
        self.query_one("#download", Button).disabled = True
        status = self.query_one("#download-status", Label)
        status.update("starting…")
        status.display = True
        self.query_one("#download-progress", ProgressBar).display = True
        self.query_one("#cancel", Button).focus()
        self._download_worker = self._download()

    @work(thread=True, exclusive=True, exit_on_error=False)
    def _download(self) -> None:
        worker = get_current_worker()

        # one bar for the model and then its projector: `fetched` is what the model brought
        fetched = 0

        def report(done: int, total: int | None) -> None:
            if worker.is_cancelled:
                raise _Cancelled
            still = 0 if fetched else self.download_size - self.cfile.size  # the projector, while the model comes
            self.post_message(self.Progress(fetched + done, None if total is None else fetched + total + still))

        try:
            model = hub.resolve_catalog(self.entry, self.cfile, self.paths, progress=report)
            if self.entry.mmproj is not None:
                fetched = model.stat().st_size
                hub.pull_projector(self.ref, self.paths, progress=report)
        except _Cancelled:
            pass  # the dialog is gone; huggingface_hub never leaves a partial file in the cache's place

    @on(Progress)
    def _progress(self, event: Progress) -> None:
        total = event.total or self.download_size
        self.query_one("#download-progress", ProgressBar).update(total=total, progress=event.done)
        self.query_one("#download-status", Label).update(f"{format_size(event.done)} of {format_size(total)}")

    @on(Worker.StateChanged)
    def _finished(self, event: Worker.StateChanged) -> None:
        if event.worker is not self._download_worker:
            return
        event.stop()
        if event.state == WorkerState.SUCCESS:
            self.dismiss(True)
        elif event.state == WorkerState.ERROR:
            error = event.worker.error
            text = str(error) if isinstance(error, EdgechatError) else f"{type(error).__name__}: {error}"
            self.query_one("#download-status", Label).update(f"Download failed: {text}")
            self.query_one("#download", Button).disabled = False

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        if self._download_worker is not None:
            # the thread stops at its next chunk; the dialog does not wait for a stalled network
            self._download_worker.cancel()
        self.dismiss(False)
