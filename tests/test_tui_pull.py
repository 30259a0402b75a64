"""The model picker offers a catalog model that is not on disk: size, licence and fit, then a
download from a local stand-in Hub with progress and a Cancel, then the model loads."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from test_hub import CATALOG_NAME, FakeHub, fake_hub  # noqa: F401  (fake_hub: the stand-in Hub fixture)
from test_tui_layout import ScriptedClient
from textual.widgets import Button, Label, ProgressBar
from tiny_mmproj import text_embedding_width, write_tiny_mmproj

from edgechat.models import catalog, hub, planner
from edgechat.tui.app import EdgechatApp
from edgechat.tui.client import LocalClient
from edgechat.tui.screens.download import DownloadScreen
from edgechat.tui.screens.models import ModelPickerScreen

pytestmark = pytest.mark.asyncio

ENTRY = catalog.load_catalog()[CATALOG_NAME]
#: bytes the stand-in Hub sends of a file before it waits for the test: two of huggingface_hub's 10 MiB chunks
HELD_AFTER = 24 << 20


@pytest.fixture
def online(fake_hub, tmp_path, monkeypatch):  # noqa: F811
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return fake_hub


@pytest.fixture
def held(online):
    """The stand-in Hub sends HELD_AFTER bytes of a file, then waits until the event is set:
    a download caught half way, whatever the speed of this machine."""
    gate = threading.Event()
    base = online.server.RequestHandlerClass

    class Writer:
        def __init__(self, raw):
            self.raw, self.sent = raw, 0

        def write(self, data):
            if self.sent >= HELD_AFTER:
                gate.wait(60)
            self.sent += len(data)
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    class Held(base):
        def setup(self):
            super().setup()
            self.wfile = Writer(self.wfile)

    online.server.RequestHandlerClass = Held
    yield gate
    gate.set()


def refusing_port() -> int:
    """A loopback port nothing listens on: a Hub that refuses every connection."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def until(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def scripted_app(paths, asked: list) -> EdgechatApp:
    client = ScriptedClient()

    def factory(ref):
        asked.append(ref)
        return client

    return EdgechatApp(paths, model=client.model_name, client_factory=factory)


async def open_download(pilot, name: str = CATALOG_NAME) -> DownloadScreen:
    """Ctrl+O, then Enter on a catalog model not downloaded (SmolLM2 360M unless `name`)."""
    app = pilot.app
    await until(pilot, lambda: app.client is not None, what="the first model")
    await pilot.press("ctrl+o")
    picker = app.screen
    assert isinstance(picker, ModelPickerScreen)
    listing = picker.query_one("#model-list")
    await until(pilot, lambda: name in picker._rows, what="the model list")
    listing.highlighted = listing.get_option_index(name)
    listing.focus()
    await pilot.press("enter")
    await until(pilot, lambda: isinstance(app.screen, DownloadScreen), what="the download dialog")
    return app.screen


def text(screen, selector: str) -> str:
    return str(screen.query_one(selector, Label).render())


def on_screen(pilot, widget) -> bool:
    return widget.display and pilot.app.screen.region.contains_region(widget.region) and widget.region.area > 0


@pytest.mark.parametrize("size", [(80, 24), (50, 30)])
async def test_picking_a_model_not_on_disk_offers_it_with_size_licence_and_fit(online, isolated_dirs, size, monkeypatch):
    asked = []
    app = scripted_app(isolated_dirs, asked)
    async with app.run_test(size=size) as pilot:
        dialog = await open_download(pilot)
        button = dialog.query_one("#download", Button)
        await until(pilot, lambda: not button.disabled, what="the Hub check")
        assert str(button.label) == "Download 258 MiB" and app.focused is button and on_screen(pilot, button)
        assert text(dialog, "#download-about") == f"258 MiB · Q4_K_M · licence {ENTRY.licence} · from {ENTRY.repo}"
        assert text(dialog, "#download-fit").startswith("fits this machine (")
        assert not dialog.query_one("#download-progress").display  # nothing downloading yet
        await pilot.pause()
        assert all(on_screen(pilot, label) for label in dialog.query(".download-dialog > Label") if label.display)
        # Escape goes back to the list, downloading nothing and loading nothing
        await pilot.press("escape")
        assert isinstance(app.screen, ModelPickerScreen) and asked == ["scripted-model"]
        assert not any("/resolve/" in path for _, path in online.requests)
        # with 200 MiB free it will not fit: said in red, and Enter is not the download
        monkeypatch.setattr(planner, "available_memory", lambda: 200 << 20)
        await pilot.press("escape")
        dialog = await open_download(pilot)
        button = dialog.query_one("#download", Button)
        await until(pilot, lambda: not button.disabled, what="the Hub check")
        fit = dialog.query_one("#download-fit", Label)
        assert str(fit.render()).startswith("will not fit in the memory free here (") and fit.has_class("no-fit")
        assert app.focused is dialog.query_one("#cancel", Button)


async def test_confirming_downloads_with_progress_then_loads_the_model(held, isolated_dirs, smollm2_path):
    asked, clients = [], []

    def factory(ref):
        asked.append(ref)
        clients.append(LocalClient(ref, isolated_dirs))
        return clients[-1]

    app = EdgechatApp(isolated_dirs, client_factory=factory)
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            dialog = await open_download(pilot)
            button = dialog.query_one("#download", Button)
            await until(pilot, lambda: not button.disabled, what="the Hub check")
            await pilot.press("enter")
            # held half way by the stand-in Hub: the bar and the words show how far it got
            bar = dialog.query_one("#download-progress", ProgressBar)
            await until(pilot, lambda: bar.progress >= 20 << 20, what="progress")
            total = smollm2_path.stat().st_size
            assert bar.display and on_screen(pilot, bar) and bar.total == total
            assert text(dialog, "#download-status") == f"20 MiB of {catalog.format_size(total)}"
            assert not hub.is_downloaded(ENTRY, ENTRY.default, isolated_dirs)
            held.set()
            await until(pilot, lambda: len(asked) == 2 and app.client is clients[-1], timeout=120, what="the load")
            assert asked[-1] == CATALOG_NAME and not isinstance(app.screen, (DownloadScreen, ModelPickerScreen))
            assert hub.is_downloaded(ENTRY, ENTRY.default, isolated_dirs)
    finally:
        for client in clients:
            client.close()


async def test_a_vision_model_comes_with_its_projector(online, isolated_dirs, smollm2_path, tmp_path, monkeypatch):
    """The catalog's vision model: the dialog counts its projector, downloads it after the model
    (as `edgechat pull` does), and the model loads reading images. The stand-in Hub serves
    SmolLM2 and the tiny projector under the catalog's names."""
    vision = catalog.load_catalog()["gemma3-4b-it"]
    assert vision.mmproj is not None
    mmproj = write_tiny_mmproj(tmp_path / "tiny-mmproj.gguf", text_embedding_width(smollm2_path))
    server = FakeHub({(vision.repo, vision.default.file): smollm2_path, (vision.repo, vision.mmproj.file): mmproj})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    clients = []

    def factory(ref):
        clients.append(LocalClient(ref, isolated_dirs))
        return clients[-1]

    app = EdgechatApp(isolated_dirs, client_factory=factory)
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            dialog = await open_download(pilot, vision.name)
            assert ", vision · " in app.screen_stack[-2]._rows[vision.name].detail  # the picker, not downloaded
            whole = vision.default.size + vision.mmproj.size
            assert f"+ vision projector {catalog.format_size(vision.mmproj.size)}" in text(dialog, "#download-about")
            button = dialog.query_one("#download", Button)
            assert str(button.label) == f"Download {catalog.format_size(whole)}"
            bar = dialog.query_one("#download-progress", ProgressBar)
            await until(pilot, lambda: not button.disabled, what="the Hub check")
            await pilot.press("enter")
            await until(pilot, lambda: len(clients) == 2 and app.client is clients[-1], timeout=120, what="the load")
            assert bar.progress == bar.total == smollm2_path.stat().st_size + mmproj.stat().st_size
            assert hub.cached_projector(vision.name, isolated_dirs).read_bytes() == mmproj.read_bytes()
            assert clients[-1].engine.modalities == ("vision",)
            # the picker now describes the downloaded model with what its projector reads
            await pilot.press("ctrl+o")
            picker = app.screen
            await until(pilot, lambda: vision.name in getattr(picker, "_rows", {}), what="the model list")
            assert "llama, vision" in picker._rows[vision.name].detail and "fits" in picker._rows[vision.name].detail
    finally:
        server.close()
        for client in clients:
            client.close()


@pytest.mark.parametrize(("size", "offline"), [((80, 24), False), ((50, 30), True)])
async def test_an_unreachable_hub_is_said_at_once_instead_of_the_download(isolated_dirs, monkeypatch, size, offline):
    if not offline:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{refusing_port()}")
    asked = []
    app = scripted_app(isolated_dirs, asked)
    async with app.run_test(size=size) as pilot:
        dialog = await open_download(pilot)
        status = dialog.query_one("#download-status", Label)
        # huggingface_hub's own retries take ~25 s; the probe answers long before this timeout
        await until(pilot, lambda: "Cannot download" in str(status.render()), timeout=10, what="the Hub check")
        why = ("HF_HUB_OFFLINE is set; unset it" if offline else
               "the Hub (127.0.0.1) cannot be reached (Connection refused); connect to the internet")
        assert text(dialog, "#download-status") == f"Cannot download: {why} and pick it again."
        await pilot.pause()  # laid out again for the longer text
        assert all(on_screen(pilot, label) for label in dialog.query(".download-dialog > Label"))
        assert not dialog.query_one("#download", Button).display
        await pilot.press("enter")  # on Cancel: back to the list, nothing loaded
        assert isinstance(app.screen, ModelPickerScreen) and asked == ["scripted-model"]


async def test_cancel_stops_a_download_and_loads_nothing(held, isolated_dirs, smollm2_path):
    asked = []
    app = scripted_app(isolated_dirs, asked)
    async with app.run_test(size=(80, 24)) as pilot:
        dialog = await open_download(pilot)
        button = dialog.query_one("#download", Button)
        await until(pilot, lambda: not button.disabled, what="the Hub check")
        await pilot.click("#download")
        bar = dialog.query_one("#download-progress", ProgressBar)
        await until(pilot, lambda: bar.progress >= 20 << 20, what="progress")
        worker = dialog._download_worker
        assert app.focused is dialog.query_one("#cancel", Button)
        await pilot.press("enter")
        assert isinstance(app.screen, ModelPickerScreen)
        held.set()  # the rest is there for the taking: the thread still stops at its next chunk
        await until(pilot, lambda: worker.is_finished, what="the download thread")
        await pilot.pause(0.5)
        # had it gone on, the whole file would be in the cache by now; no half file is either
        assert not hub.is_downloaded(ENTRY, ENTRY.default, isolated_dirs)
        assert all(p.name.endswith(".incomplete") for p in hub.hub_cache(isolated_dirs).glob("models--*/blobs/*"))
        assert asked == ["scripted-model"]
