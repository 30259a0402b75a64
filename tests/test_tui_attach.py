"""Attachments and presets in the chat app: files into a message (text, PDF, pastes), what is
refused and why, presets applied to a conversation; the scripted client for the screen, the real
embedded model where its tokens and prompt matter."""

from __future__ import annotations

import re

import pytest
from test_tui_layout import ScriptedClient, make_app, until
from textual import events

from edgechat.attachments import GAP, MAX_FILE_BYTES, Attachment, excerpts, gather, read_file, split
from edgechat.errors import UsageError
from edgechat.tui.app import EdgechatApp
from edgechat.tui.client import LocalClient
from edgechat.tui.presets import SHIPPED, load_presets
from edgechat.tui.screens.dialogs import ConfirmScreen
from edgechat.tui.screens.pickers import AttachPickerScreen, PresetPickerScreen

pytestmark = pytest.mark.asyncio

SECRET = "The lighthouse code word is PERIWINKLE-42."
#: a paragraph of its own about the code word, in a file of figures
KEEPER_NOTE = (f"A note from the keeper of the lighthouse on the northern cape. {SECRET} "
               "Give the lighthouse code word to the relief keeper at the lighthouse door.")


class Recording:
    """A client that keeps every request it is given (the rest is the wrapped client's)."""

    def __init__(self, inner):
        self.inner = inner
        self.requests = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, request):
        self.requests.append(request)
        return self.inner.submit(request)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_path):
    """The real model with a 2,048-token context: a few pages of text do not fit it."""
    from edgechat.config import get_paths

    c = LocalClient(str(smollm2_path), get_paths(tmp_path_factory.mktemp("attach-engine")), n_ctx=2048)
    yield c
    c.close()


@pytest.fixture
def paths(isolated_dirs):
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 4\ntemperature = 0.0\nseed = 7\n")
    return isolated_dirs


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


async def command(pilot, text: str) -> None:
    screen = pilot.app.chat_screen
    screen.prompt.set_text(text)
    screen.prompt.focus()
    await pilot.press("enter")
    await pilot.pause(0.05)


async def counted(pilot, n: int) -> None:
    bar = pilot.app.chat_screen.attach_bar
    await until(pilot, lambda: len(bar.chips) == n and bar.counted)


async def test_attached_file_is_sent_as_a_fenced_block_and_stored_by_name(paths, tmp_path):
    (tmp_path / "notes.md").write_text("# Notes\n\n" + SECRET + "\n```sh\nls\n```\n")
    client = ScriptedClient(text="ok")
    app = make_app(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.client is not None)
        screen = app.chat_screen
        await command(pilot, f"/attach {tmp_path / 'notes.md'}")
        await counted(pilot, 1)
        chip = screen.attach_bar.chips[0]
        assert "notes.md" in chip.label() and "~" in chip.label()  # no tokenizer here: an estimate
        await command(pilot, "What is the code word?")
        await until(pilot, lambda: screen.turn is None and len(app.store.messages(screen.conv.id)) == 2)
        user = app.store.messages(screen.conv.id)[0]
        # the file in a fence longer than its own, named, then the question
        assert user.content.startswith("File: notes.md\n````md\n# Notes")
        assert SECRET in user.content and user.content.endswith("````\n\nWhat is the code word?")
        assert [f["name"] for f in user.meta["attachments"]] == ["notes.md"]
        assert client.requests[-1].messages[-1]["content"] == user.content
        assert screen.conv.title == "What is the code word?"
        # shown as a chip line and the question, not the file; the bar is empty again
        box = screen.chat.boxes()[0]
        assert str(box.query_one(".attached").render()) == "▪ notes.md"
        assert str(box.query_one(".body").render()) == "What is the code word?"
        assert screen.attach_bar.chips == []
        # editing the message puts the file back as a chip and the question in the input
        screen.turn_part.edit_message(user)
        await counted(pilot, 1)
        assert screen.prompt.text == "What is the code word?"
        assert screen.attach_bar.attachments[0].text.startswith("# Notes")


async def test_real_model_is_given_the_file_and_answers(paths, engine, tmp_path):
    (tmp_path / "memo.txt").write_text(f"Shopping list.\n{SECRET}\nMilk, eggs.\n")
    client = Recording(engine)
    app = EdgechatApp(paths, client_factory=lambda ref: client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.client is not None, timeout=60)
        screen = app.chat_screen
        await command(pilot, f"/attach {tmp_path / 'memo.txt'}")
        await counted(pilot, 1)
        tokens = screen.attach_bar.chips[0].tokens
        assert 15 < tokens < 60  # the model's own count of the block
        assert "% of 2,048 context tokens" in str(screen.attach_bar.query_one("#attach-summary").render())
        await command(pilot, "Repeat the code word from the memo.")
        await until(pilot, lambda: screen.turn is None and len(app.store.messages(screen.conv.id)) == 2, timeout=60)
        prompt = engine.engine.detokenize(engine.engine.prompt_tokens(client.requests[-1]))
        assert "File: memo.txt" in prompt and SECRET in prompt and prompt.rstrip().endswith("assistant")
        answer = app.store.messages(screen.conv.id)[1]
        assert answer.status == "complete" and answer.content.strip() and answer.meta["completion_tokens"] > 0


def figures(lines: range) -> str:
    return "\n".join(f"Line {i}: the quarterly figures rose by {i % 17} percent." for i in lines)


def quarterly_report(path, note_at: int | None = None):
    if note_at is None:
        path.write_text(figures(range(400)))
    else:
        path.write_text(f"{figures(range(note_at))}\n\n{KEEPER_NOTE}\n\n{figures(range(note_at, 400))}")
    return path


async def test_too_large_for_the_context_is_refused_with_the_figures(paths, engine, tmp_path):
    big = quarterly_report(tmp_path / "report.txt")
    app = EdgechatApp(paths, client_factory=lambda ref: engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.client is not None, timeout=60)
        screen = app.chat_screen
        await command(pilot, f"/attach {big}")
        await counted(pilot, 1)
        await command(pilot, "Summarise it.")
        # the local model can embed, so the refusal offers the relevant parts instead
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        refusal = app.screen.question
        assert refusal.startswith("Too large") and "\n" not in refusal
        # the attachments' tokens, what the context allows (2,048 less max_tokens for the answer),
        # and how much of attachments would fit
        took, allowed, fit = (int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*(?= tokens| for)", refusal))
        assert abs(took - screen.attach_bar.tokens) <= 2 and took > 2044
        assert allowed == 2048 - 4 and 2000 < fit < 2044
        await pilot.press("escape")
        await pilot.pause(0.05)
        # nothing stored or lost: the question stays in the input, the file above it
        assert screen.conv is None and screen.prompt.text == "Summarise it."
        assert [c.attachment.name for c in screen.attach_bar.chips] == ["report.txt"]


async def test_a_file_too_large_is_sent_as_its_parts_nearest_the_question(paths, engine, tmp_path):
    big = quarterly_report(tmp_path / "report.txt", note_at=250)
    client = Recording(engine)
    app = EdgechatApp(paths, client_factory=lambda ref: client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.client is not None, timeout=60)
        screen = app.chat_screen
        await command(pilot, f"/attach {big}")
        await counted(pilot, 1)
        await command(pilot, "What is the lighthouse code word?")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("enter")  # "Send the relevant parts" has the focus
        # the answer is stored at once (as interrupted) before its turn starts: wait for its end
        await until(pilot, lambda: screen.conv is not None and screen.turn is None
                    and [m.status for m in app.store.messages(screen.conv.id)][1:] == ["complete"], timeout=120)
        user = app.store.messages(screen.conv.id)[0]
        assert [a["name"] for a in user.meta["attachments"]] == ["report.txt (excerpts)"]
        sent, text = split(user.content, 1)
        assert text == "What is the lighthouse code word?" and SECRET in sent[0].text
        # parts, in the file's order, with the gaps marked: less than the whole, within the context
        kept = [line for line in sent[0].text.splitlines() if line.startswith("Line ")]
        numbers = [int(line.split(":")[0].split()[1]) for line in kept]
        assert numbers == sorted(numbers) and 0 < len(kept) < 399 and GAP.strip() in sent[0].text
        tokens, limit = engine.prompt_room(client.requests[-1])
        assert tokens <= limit
        assert app.store.messages(screen.conv.id)[1].status == "complete"


async def test_excerpts_rank_by_the_models_embeddings_and_keep_to_the_budget(engine):
    short = figures(range(200, 204))  # a paragraph of figures as long as the keeper's note
    files = [Attachment("a.txt", figures(range(60))),
             Attachment("b.txt", f"{figures(range(60))}\n\n{short}\n\n{KEEPER_NOTE}\n\n{figures(range(60, 120))}")]
    count = lambda text: len(engine.engine.tokenize(text))  # noqa: E731
    question = "What is the lighthouse code word?"
    # room for one of the two short paragraphs and nothing longer: the embeddings choose
    budget = max(count(short + "\n\n"), count(KEEPER_NOTE + "\n\n"))
    one = excerpts(files, question, budget, count, engine.embed)
    assert [(a.name, a.text.strip()) for a in one] == [("b.txt (excerpts)", KEEPER_NOTE)]
    everything = excerpts(files, question, 10**6, count, engine.embed)
    assert [a.text for a in everything] == [f.text for f in files]  # all of it: no gap, nothing lost
    assert excerpts(files, question, 5, count, engine.embed) == []


async def test_binary_and_missing_paths_each_get_one_line(paths, tmp_path):
    # (a picture is an image attachment now: tests/test_tui_vision.py)
    (tmp_path / "blob.bin").write_bytes(b"\x7fELF\2\1\1\0" + bytes(range(256)))
    app = make_app(paths)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        await command(pilot, f"/attach {tmp_path / 'blob.bin'}")
        await command(pilot, f"/attach {tmp_path / 'nowhere.txt'}")
        lines = notes(app)[-2:]
        assert lines == [
            "Cannot attach blob.bin: binary; attach text, source code, Markdown, JSON/CSV or PDF files.",
            "Cannot attach nowhere.txt: no such file.",
        ]
        assert screen.attach_bar.chips == [] and screen.attach_bar.has_class("-empty")


async def test_folders_and_globs_with_the_size_cap_saying_what_it_skipped(paths, tmp_path):
    src = tmp_path / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: main\n")
    (src / "README.md").write_text("# proj\n")
    (src / "pkg" / "app.py").write_text("print('hi')\n")
    (src / "data.csv").write_text("a,b\n1,2\n")
    (src / "huge.log").write_text("x" * (MAX_FILE_BYTES + 1))
    (src / "lib.so").write_bytes(b"\x7fELF\0\0\0")
    app = make_app(paths)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        await command(pilot, f'/attach "{src}"')
        await counted(pilot, 3)
        names = [a.name for a in screen.attach_bar.attachments]
        assert names == ["proj/README.md", "proj/data.csv", "proj/pkg/app.py"]  # no .git, none skipped
        assert notes(app)[-1] == "Attached proj/README.md, proj/data.csv, proj/pkg/app.py; " \
                                 "skipped 2: proj/huge.log (over 512 KB), proj/lib.so (binary)."
        await command(pilot, "/detach")
        await until(pilot, lambda: screen.attach_bar.chips == [])
        await command(pilot, f"/attach {src}/*.md {src}/**/*.py")
        await counted(pilot, 2)
        assert [a.lang for a in screen.attach_bar.attachments] == ["md", "py"]


async def test_a_folder_is_read_up_to_the_file_cap(tmp_path, monkeypatch):
    monkeypatch.setattr("edgechat.attachments.MAX_FILES", 3)
    for i in range(6):
        (tmp_path / f"{i}.txt").write_text(f"{i}\n")
    found = gather(str(tmp_path), cwd=tmp_path)
    assert [a.name for a in found.attachments] == [f"{tmp_path.name}/{i}.txt" for i in range(3)]
    assert found.summary().endswith(f"skipped 1: {tmp_path.name}/3.txt (over 3 files; nothing after it was read).")


def _pdf(text: str) -> bytes:
    """A one-page PDF showing `text` in Helvetica, with a correct cross-reference table."""
    stream = f"BT /F1 18 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


async def test_pdf_text_is_extracted(paths, tmp_path):
    pdf = tmp_path / "invoice.pdf"
    pdf.write_bytes(_pdf("Invoice 1138: total due 42 euros"))
    attachment = read_file(pdf)
    assert attachment.text == "Invoice 1138: total due 42 euros" and attachment.lang == "text"
    app = make_app(paths)
    async with app.run_test(size=(100, 30)) as pilot:
        await command(pilot, f"/attach {pdf}")
        await counted(pilot, 1)
        assert "Invoice 1138" in app.chat_screen.attach_bar.attachments[0].block()


async def test_a_pasted_path_or_a_long_paste_becomes_an_attachment(paths, tmp_path):
    (tmp_path / "dropped file.txt").write_text("dropped\n")
    app = make_app(paths)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        prompt = screen.prompt
        # a file dropped on the terminal arrives as its path, quoted or escaped (the app hands a
        # terminal's paste to the focused widget, as here)
        app.post_message(events.Paste(f"'{tmp_path / 'dropped file.txt'}'"))
        await counted(pilot, 1)
        app.post_message(events.Paste("word " * 500))
        await counted(pilot, 2)
        assert [a.name for a in screen.attach_bar.attachments] == ["dropped file.txt", "pasted text 1"]
        assert prompt.text == ""
        # anything else is typed, once
        app.post_message(events.Paste("/not/a/file and some words"))
        await until(pilot, lambda: prompt.text == "/not/a/file and some words")
        # a click on a chip takes it off
        await pilot.click(screen.attach_bar.chips[0])
        await until(pilot, lambda: [a.name for a in screen.attach_bar.attachments] == ["pasted text 1"])


async def test_shipped_and_configured_presets_load(paths):
    paths.config_file.write_text(
        '[presets.pirate]\ndescription = "arr"\nsystem_prompt = "Talk like a pirate."\ntemperature = 1.1\n'
        '[presets.code]\ntemperature = 0.0\n'
    )
    presets = load_presets(paths)
    assert set(SHIPPED) <= set(presets) and {"concise", "code", "translator"} <= set(presets)
    assert presets["pirate"].settings == {"system_prompt": "Talk like a pirate.", "temperature": 1.1}
    assert presets["code"].settings == {"temperature": 0.0}  # config.toml's replaces the shipped one
    for name in SHIPPED:
        assert len(SHIPPED[name]["system_prompt"]) < 400  # each one short
    # a mistake in one is one line naming it and what a preset takes
    paths.config_file.write_text('[presets.hot]\ntemperture = 2.0\n')
    with pytest.raises(UsageError, match=r"\[presets\.hot\]: unknown temperture; a preset takes description, model, "):
        load_presets(paths)
    paths.config_file.write_text('[presets.hot]\ntop_p = 7\n')
    with pytest.raises(UsageError, match=r"\[presets\.hot\]: top-p must be between 0 and 1 \(got 7\); 1 = off$"):
        load_presets(paths)


async def test_preset_applies_to_the_conversation_and_a_bad_name_lists_them(paths):
    client = ScriptedClient(text="ok")
    app = make_app(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.client is not None)
        screen = app.chat_screen
        await command(pilot, "/preset nonsense")
        assert notes(app)[-1].startswith("No preset 'nonsense'; presets: code, concise, translator")
        assert "\n" not in notes(app)[-1]
        await command(pilot, "/preset code")
        assert screen.conv.settings["system_prompt"] == SHIPPED["code"]["system_prompt"]
        assert screen.conv.settings["temperature"] == 0.2 and screen.conv.settings["top_p"] == 0.95
        assert screen.conv.settings["max_tokens"] == 4  # what the preset leaves alone stays
        await command(pilot, "Hello")
        await until(pilot, lambda: screen.turn is None and client.requests)
        request = client.requests[-1]
        assert request.messages[0] == {"role": "system", "content": SHIPPED["code"]["system_prompt"]}
        assert request.sampling.temperature == 0.2
        # the picker: a list of them, Enter applies the highlighted one
        await command(pilot, "/preset")
        await until(pilot, lambda: isinstance(app.screen, PresetPickerScreen))
        await pilot.press("down", "enter")  # (sorted: code, concise, translator)
        await until(pilot, lambda: not isinstance(app.screen, PresetPickerScreen))
        assert screen.conv.settings["thinking"] == "off" and screen.conv.settings["temperature"] == 0.3


async def test_usable_at_50_columns(paths, tmp_path):
    (tmp_path / "docs").mkdir()
    for name in ("a-rather-long-file-name-for-a-phone-screen.md", "b.txt"):
        (tmp_path / "docs" / name).write_text("text\n")
    app = make_app(paths)
    async with app.run_test(size=(50, 30)) as pilot:
        screen = app.chat_screen
        await command(pilot, f"/attach {tmp_path / 'docs'}")
        await counted(pilot, 2)
        bar = screen.attach_bar
        assert all(c.region.width <= 50 and c.region.height == 1 for c in bar.chips)
        assert bar.region.bottom <= screen.prompt.region.y and screen.prompt.region.height >= 3
        # the file picker (Ctrl+L) and the preset picker fit the width
        await pilot.press("ctrl+l")
        await until(pilot, lambda: isinstance(app.screen, AttachPickerScreen))
        assert app.screen.query_one(".dialog").region.width <= 50
        await pilot.press("escape")
        await command(pilot, "/preset")
        await until(pilot, lambda: isinstance(app.screen, PresetPickerScreen))
        assert app.screen.query_one(".dialog").region.width <= 50
