"""Pictures in the chat app (Pilot) and in `edgechat run --image`, on the embedded SmolLM2 with
the tiny projector tests/tiny_mmproj.py writes (random weights: it says nothing of what a picture
shows, and no test reads meaning into an answer). What is checked: the chip and its size, the
picture stored with its message and sent as an image part, the next turn reusing its cells
(cached tokens, no second encode), a text-only model's one-line refusal that loses nothing,
the remote client's data URL, and the CLI's answer changing with the picture."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from test_cli import assert_one_line_error, edgechat
from test_tui_attach import command, notes
from test_tui_flows import app_for, ready, send, until
from tiny_mmproj import CHECKS, GRADIENT, N_IMAGE_TOKENS, text_embedding_width, write_tiny_mmproj

from edgechat.attachments import ImageAttachment, file_size
from edgechat.engine import ChatRequest, ImageInput
from edgechat.engine.runners.media import no_vision
from edgechat.tui.client import LocalClient, RemoteClient

pytestmark = [pytest.mark.slow]

QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def mmproj(smollm2_path, tmp_path_factory):
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf", text_embedding_width(smollm2_path))


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_path, mmproj):
    """SmolLM2 reading pictures through the tiny projector (as `--mmproj FILE` gives it)."""
    from edgechat.config import get_paths

    c = LocalClient(str(smollm2_path), get_paths(tmp_path_factory.mktemp("vision-engine")), engine_options={"mmproj": str(mmproj)})
    yield c
    c.close()


@pytest.fixture(scope="module")
def text_client(tmp_path_factory, smollm2_path):
    from edgechat.config import get_paths

    c = LocalClient(str(smollm2_path), get_paths(tmp_path_factory.mktemp("text-engine")))
    yield c
    c.close()


@pytest.fixture
def paths(isolated_dirs):
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 8\ntemperature = 0.0\nseed = 7\n")
    return isolated_dirs


@pytest.fixture
def picture(tmp_path):
    path = tmp_path / "gradient.png"
    path.write_bytes(GRADIENT)
    return path


@pytest.mark.asyncio
async def test_image_shows_a_chip_is_answered_stored_and_its_cells_reused(paths, client, picture):
    app = app_for(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        assert client.image_refusal is None
        await command(pilot, f"/image {picture}")
        (chip,) = screen.attach_bar.chips
        assert chip.label() == f"✕ {file_size(len(GRADIENT))} image · gradient.png"
        assert str(screen.attach_bar.query_one("#attach-summary").render()) == "1 image"
        encodes = client.engine.projector.encodes
        await send(pilot, QUESTION)
        user, answer = app.store.messages(screen.conv.id)
        assert answer.status == "complete" and answer.content.strip()
        assert answer.meta["prompt_tokens"] >= N_IMAGE_TOKENS
        assert client.engine.projector.encodes == encodes + 1
        # stored: the bytes as a file named by their hash in the data directory, referenced by the message
        digest = hashlib.sha256(GRADIENT).hexdigest()
        assert [i.sha256 for i in user.images] == [digest]
        assert (paths.data / "images" / digest).read_bytes() == GRADIENT
        assert user.content == QUESTION and user.meta["images"] == [{"name": "gradient.png", "bytes": len(GRADIENT)}]
        box = screen.chat.boxes()[0]
        assert str(box.query_one(".attached").render()) == f"▪ gradient.png ({file_size(len(GRADIENT))} image)"
        assert screen.attach_bar.chips == [] and screen.conv.title == QUESTION

        # the next turn sends the picture again from the store: its cells are reused, not encoded again
        await send(pilot, "Say more.")
        second = app.store.messages(screen.conv.id)[-1]
        assert second.status == "complete"
        assert client.engine.projector.encodes == encodes + 1
        assert second.meta["cached_tokens"] >= answer.meta["prompt_tokens"]
        assert client.engine.kv_problems() == []

        # editing the first message puts the picture back as a chip
        screen.turn_part.edit_message(app.store.get_message(user.id))
        await until(pilot, lambda: len(screen.attach_bar.chips) == 1, what="the chip")
        assert screen.attach_bar.images[0].data == GRADIENT and screen.prompt.text == QUESTION


@pytest.mark.asyncio
async def test_a_text_only_model_refuses_in_one_line_and_keeps_the_text(paths, text_client, picture):
    app = app_for(paths, text_client)
    line = no_vision(text_client.model_name)
    assert text_client.image_refusal == line and "edgechat pull gemma3-4b-it" in line and "--mmproj FILE" in line
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        screen.prompt.set_text(QUESTION)
        screen.action_image(str(picture))  # (from the palette: the typed text is in the input)
        await pilot.pause(0.05)
        assert notes(app)[-1] == line
        assert screen.attach_bar.chips == [] and screen.prompt.text == QUESTION
        # /attach with a text file and a picture: the text file goes, the picture is refused
        (picture.parent / "notes.txt").write_text("a note")
        screen.action_attach(f"{picture.parent / 'notes.txt'} {picture}")
        await pilot.pause(0.05)
        assert line in notes(app)
        assert [c.attachment.name for c in screen.attach_bar.chips] == ["notes.txt"]
        # a picture attached before (another model) is refused at the send: nothing is stored or lost
        screen.attach_bar.add([ImageAttachment("gradient.png", GRADIENT, "image/png")], None)
        await pilot.pause(0.05)
        await pilot.press("enter")
        await pilot.pause(0.05)
        assert notes(app)[-1] == line
        assert screen.conv is None and screen.prompt.text == QUESTION and len(screen.attach_bar.chips) == 2


def test_the_remote_client_sends_pictures_as_data_urls():
    remote = RemoteClient.__new__(RemoteClient)  # no server to list models from: only the body is built
    remote.model_name = "m"
    request = ChatRequest(messages=[{"role": "user", "content": [ImageInput(GRADIENT, "image/png"), QUESTION]}])
    (message,) = remote.body(request)["messages"]
    assert message == {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(GRADIENT).decode()}},
        {"type": "text", "text": QUESTION}]}


def run_json(*args):
    proc = edgechat("run", "--json", "--temperature", "0", "--max-tokens", "12", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_run_image_changes_the_greedy_answer(isolated_dirs, smollm2_path, mmproj, tmp_path):
    (tmp_path / "g.png").write_bytes(GRADIENT)
    (tmp_path / "c.png").write_bytes(CHECKS)
    model = ["-m", str(smollm2_path), "--mmproj", str(mmproj), "--deterministic"]
    bare = run_json(*model, QUESTION)
    seen = run_json(*model, "--image", str(tmp_path / "g.png"), QUESTION)
    again = run_json(*model, "--image", str(tmp_path / "g.png"), QUESTION)
    two = run_json(*model, "--image", str(tmp_path / "g.png"), "--image", str(tmp_path / "c.png"), QUESTION)
    assert seen["text"] != bare["text"] and seen["text"] == again["text"]
    assert seen["prompt_tokens"] == bare["prompt_tokens"] + N_IMAGE_TOKENS
    assert two["prompt_tokens"] == bare["prompt_tokens"] + 2 * N_IMAGE_TOKENS


def test_run_image_bad_input_is_one_line(isolated_dirs, smollm2_path, mmproj, tmp_path):
    missing = edgechat("run", "-m", str(smollm2_path), "--mmproj", str(mmproj), "--image", str(tmp_path / "nowhere.png"), QUESTION)
    assert_one_line_error(missing, "cannot read --image", "nowhere.png", "no such file")
    # a WebP (llama.cpp's loader reads PNG, JPEG, GIF, BMP) and a text file are refused before the model loads
    (tmp_path / "w.webp").write_bytes(b"RIFF\x16\0\0\0WEBPVP8L\x05\0\0\0\x2f\xff\xff\x07\0")
    (tmp_path / "notes.png").write_text("not a picture")
    for name, words in (("w.webp", "convert it to PNG"), ("notes.png", "not a PNG, JPEG, GIF or BMP")):
        refused = edgechat("run", "-m", str(smollm2_path), "--mmproj", str(mmproj), "--image", str(tmp_path / name), QUESTION)
        assert_one_line_error(refused, f"cannot read --image {tmp_path / name}", words)
    (tmp_path / "g.png").write_bytes(GRADIENT)
    text_only = edgechat("run", "-m", str(smollm2_path), "--image", str(tmp_path / "g.png"), QUESTION)
    assert_one_line_error(text_only, "reads text only", "edgechat pull gemma3-4b-it")
    session = edgechat("run", "-m", str(smollm2_path), "--session", "pics", "--image", str(tmp_path / "g.png"), QUESTION)
    assert_one_line_error(session, "reads text only")
    assert not (isolated_dirs.data / "images").exists()  # the refused turn stored nothing
    assert "pics" not in edgechat("sessions").stdout  # nor created the session


def test_run_session_stores_the_picture_and_the_next_turn_reuses_it(isolated_dirs, smollm2_path, mmproj, tmp_path):
    (tmp_path / "g.png").write_bytes(GRADIENT)
    model = ["-m", str(smollm2_path), "--mmproj", str(mmproj)]
    first = run_json(*model, "--session", "pics", "--image", str(tmp_path / "g.png"), QUESTION)
    second = run_json(*model, "--session", "pics", "Say more.")
    assert second["cached_tokens"] >= first["prompt_tokens"]  # the snapshot holds the picture's cells
    digest = hashlib.sha256(GRADIENT).hexdigest()
    assert (isolated_dirs.data / "images" / digest).read_bytes() == GRADIENT
