"""The model picker: embedded, cached and catalog models with size, quant, architecture and fit,
and which are loaded in this process (switching to one needs no load); or any .gguf path or ONNX
folder."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from edgechat.config import Paths
from edgechat.errors import EdgechatError
from edgechat.tui.screens.download import DownloadScreen


@dataclass
class ModelRow:
    ref: str
    detail: str
    fits: bool | None = None
    #: a catalog model not on disk: picking it offers the download first
    to_download: bool = False
    #: its file on disk, when it has one
    path: object | None = None


def describe(ref: str, path, paths: Paths, note: str = "") -> ModelRow:
    """Size, quant, architecture (and what its projector reads), and whether the planner says it
    fits here, its projector counted."""
    from edgechat.models.catalog import format_size
    from edgechat.models.ggufinfo import read_projector_info
    from edgechat.models.onnxinfo import read_info
    from edgechat.models.planner import choose_context, projector_bytes
    from edgechat.models.settings import projector_for

    try:
        info = read_info(path)
        projector = projector_for(paths, ref, path)
        reads = read_projector_info(projector).modalities if projector else ()
    except EdgechatError as exc:
        return ModelRow(ref, f"unreadable: {exc}", False)
    detail = f"{format_size(info.size_bytes)} · {info.quant} · {', '.join([info.architecture, *reads])}"
    try:
        plan = choose_context(info, projector=projector_bytes(projector))
        fits, detail = True, detail + f" · fits (ctx {plan.n_ctx})"
    except EdgechatError:
        fits, detail = False, detail + " · too large for free memory"
    return ModelRow(ref, detail + (f" · {note}" if note else ""), fits, path=path)


def local_models(paths: Paths) -> list[ModelRow]:
    """Embedded models (without assembling one that is not yet on disk), .gguf files and ONNX
    folders in the cache."""
    from edgechat.models.embedded import EMBEDDED, GEMMA3_FILE
    from edgechat.models.onnxinfo import is_onnx_folder

    rows = []
    for name, model in EMBEDDED.items():
        if name == "gemma3-270m" and not (paths.models_cache / GEMMA3_FILE).is_file():
            # Assembling it copies 250 MB: do that when it is picked, not to draw a list.
            rows.append(ModelRow(name, f"{model.description} · assembled on first use"))
            continue
        try:
            rows.append(describe(name, model.locate(paths), paths, model.description))
        except EdgechatError as exc:
            rows.append(ModelRow(name, str(exc), False))
    if paths.models_cache.is_dir():
        for path in sorted(paths.models_cache.glob("*.gguf")):
            if path.name != GEMMA3_FILE:
                rows.append(describe(path.stem, path, paths))
        rows += [describe(path.name, path, paths) for path in sorted(paths.models_cache.iterdir()) if is_onnx_folder(path)]
    return rows


def catalog_models(paths: Paths) -> list[ModelRow]:
    """The curated catalog: downloaded entries described like local files, the others with their
    download size (picking one offers to download it)."""
    from edgechat.models.catalog import catalog_row, load_catalog
    from edgechat.models.hub import cached_file

    rows = []
    for entry in load_catalog().values():
        cfile = entry.default
        path = cached_file(entry.repo, cfile.file, paths)
        if path is not None:
            rows.append(describe(entry.name, path, paths, entry.description))
        else:
            row = catalog_row(entry, cfile)
            arch = ", ".join([row.architecture, *(["vision"] if entry.mmproj else [])])
            rows.append(ModelRow(entry.name, f"{row.size} · {row.quant} · {arch} · {row.description} · "
                                             f"not downloaded (edgechat pull {entry.name})", row.fits, True))
    return rows


class ModelPickerScreen(ModalScreen[str | None]):
    """Returns the chosen model reference (name or path), or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, paths: Paths, current: str | None, remote_models: list[str] | None = None,
                 loaded: dict[str, tuple[str, int]] | None = None):
        super().__init__(classes="dialog-screen")
        self.paths = paths
        self.current = current
        self.remote_models = remote_models
        #: models loaded in this process: file -> (display name, bytes), as LocalModels.loaded gives
        self.loaded = loaded or {}
        self._rows: dict[str, ModelRow] = {}

    def compose(self):
        with Vertical(classes="dialog models-dialog"):
            yield Label(f"Model (now: {self.current or 'none'})", classes="dialog-title", markup=False)
            yield OptionList(Option(Text("looking for models…", style="italic"), disabled=True), id="model-list")
            yield Input(placeholder="or a path to a .gguf file or an ONNX folder, Enter to load", id="model-path")

    def on_mount(self) -> None:
        self.query_one("#model-list", OptionList).focus()
        self._scan()

    @work(thread=True, exclusive=True)
    def _scan(self) -> None:
        if self.remote_models is not None:
            rows = [ModelRow(name, "on the server") for name in self.remote_models]
        else:
            rows = local_models(self.paths)
            listed = {row.ref for row in rows}
            rows += [row for row in catalog_models(self.paths) if row.ref not in listed]
        self.app.call_from_thread(self._show, rows)

    def _loaded_label(self, row: ModelRow) -> str | None:
        held = self.loaded.get(str(row.path)) if row.path is not None else None
        return None if held is None else f"● loaded · {held[1] / 2**20:.0f} MB"

    def _show(self, rows: list[ModelRow]) -> None:
        # a model loaded from a path the lists do not hold (/model FILE) is listed too, first
        listed = {str(row.path) for row in rows if row.path is not None}
        rows = [ModelRow(path, f"{name} · {path}", True, path=path)
                for path, (name, _) in self.loaded.items() if path not in listed] + rows
        self._rows = {row.ref: row for row in rows}
        options = []
        for row in rows:
            label = Text(row.ref, style="bold")
            held = self._loaded_label(row)
            if held:
                label.append("  " + held, style="green")
            label.append("\n")
            label.append(row.detail, style="dim" if row.fits is not False else "red")
            options.append(Option(label, id=row.ref))
        listing = self.query_one("#model-list", OptionList)
        listing.set_options(options)
        if options:
            listing.highlighted = 0

    @on(OptionList.OptionSelected, "#model-list")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        ref = event.option.id
        assert ref is not None  # (every row's id is its ref)
        if not self._rows[ref].to_download:
            self.dismiss(ref)
            return
        from edgechat.models.catalog import load_catalog

        entry = load_catalog()[ref]

        def downloaded(done: bool | None) -> None:
            if done:
                self.dismiss(ref)  # loads as if it had been on disk all along

        self.app.push_screen(DownloadScreen(entry, entry.default, self.paths), downloaded)

    @on(Input.Submitted, "#model-path")
    def _path(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
