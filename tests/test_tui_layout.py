"""Layout and widget behaviour of the chat app, and snapshots of its screens.

These use a scripted client (fixed text, fixed metrics) so that what is on screen is the same on
every run; the flows with the real model are in test_tui_flows.py.
"""

from __future__ import annotations

import threading
import time

import pytest
from textual.widgets._toast import Toast

from edgechat.engine.types.request import Finished, Metrics, RequestMetrics, TextDelta
from edgechat.errors import UsageError
from edgechat.tui.app import EdgechatApp
from edgechat.tui.widgets.chatview import PAGE, ChatView

ANSWER = "Here is a short answer with **bold** text and a list:\n\n- one\n- two\n\n```python\nprint('hello')\n```\n"


class ScriptedHandle:
    def __init__(self, parts: list[str], delay: float):
        self.parts = parts
        self.delay = delay
        self._cancel = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def __iter__(self):
        text = ""
        for part in self.parts:
            if self._cancel.wait(self.delay):  # a stop ends the wait at once, as the engine's does
                break
            text += part
            yield TextDelta(part)
        m = RequestMetrics(
            ttft=0.05,
            decode=1.0,
            prompt_tokens=20,
            completion_tokens=len(self.parts) + 1,
            context_tokens=20 + len(self.parts),
            context_size=2048,
        )
        yield Metrics(m)
        yield Finished("cancelled" if self.cancelled else "stop", text, m)


class ScriptedClient:
    """Answers every request with the same text, split into small deltas like a model's tokens."""

    model_name = "scripted-model"
    backend = "CPU"
    n_ctx = 2048
    template_mode = "chat"
    template_warning = None
    image_refusal = None

    def __init__(self, text: str = ANSWER, delay: float = 0.0):
        self.parts = [text[i : i + 3] for i in range(0, len(text), 3)]
        self.delay = delay
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        return ScriptedHandle(self.parts, self.delay)

    def release_session(self, session: str) -> None:
        pass

    def forget_session(self, session: str) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def fixed_memory(monkeypatch):
    # The status bar shows process memory; fix it so screenshots do not change run to run.
    monkeypatch.setattr("edgechat.tui.widgets.statusbar.process_rss", lambda: 200 * 2**20)


def make_app(paths, client=None) -> EdgechatApp:
    client = client or ScriptedClient()
    # named as the client names itself: no word about the embedded demo model while it loads
    return EdgechatApp(paths, model=client.model_name, client_factory=lambda ref: client)


def seed(store, n_convs: int = 3):
    convs = []
    for i in range(n_convs):
        c = store.create_conversation(model="scripted-model")
        store.add_message(
            c.id, "user", ["How do I print in Python?", "Plan a trip to Lisbon", "Explain KV caches"][i % 3]
        )
        store.add_message(c.id, "assistant", ANSWER)
        convs.append(c)
    return convs


async def until(pilot, condition, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a measurement
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.02)


# -- layout ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_narrow_layout_sidebar_is_a_toggle(isolated_dirs):
    app = make_app(isolated_dirs)
    convs = seed(app.store)
    async with app.run_test(size=(50, 30)) as pilot:
        screen = app.chat_screen
        assert screen.has_class("-narrow")
        assert not screen.sidebar.display or screen.sidebar.region.width == 0
        assert screen.query_one("#main").region.width == 50
        await pilot.click("#toggle-sidebar")
        await pilot.pause()
        assert screen.sidebar.region.width == 50 and screen.query_one("#main").region.width == 0
        await pilot.click("#close-sidebar")
        await pilot.pause()
        assert screen.query_one("#main").region.width == 50
        await pilot.click("#toggle-sidebar")
        await pilot.pause()
        # picking a conversation closes the sidebar again
        options = screen.sidebar.options
        options.focus()
        options.highlighted = 2  # under the "Today" heading
        await pilot.press("enter")
        await pilot.pause()
        assert screen.conv.id == convs[1].id
        assert screen.query_one("#main").region.width == 50
        # resizing to wide shows both; Ctrl+B hides the sidebar there
        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        assert not screen.has_class("-narrow") and screen.sidebar.region.width == 30
        await pilot.press("ctrl+b")
        await pilot.pause()
        assert screen.query_one("#main").region.width == 100
        await pilot.resize_terminal(40, 20)
        await pilot.pause()
        assert screen.prompt.region.width > 0 and screen.status.region.width == 40


@pytest.mark.asyncio
async def test_prompt_keys_send_newline_history(isolated_dirs):
    client = ScriptedClient("ok")
    app = make_app(isolated_dirs, client)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.chat_screen
        await until(pilot, lambda: app.client is not None)
        await pilot.press(*"first", "ctrl+j", *"line")
        assert screen.prompt.text == "first\nline"
        await pilot.press("enter")
        await until(pilot, lambda: screen.turn is None and len(screen.chat.boxes()) == 2)
        assert client.requests[-1].messages[-1] == {"role": "user", "content": "first\nline"}
        assert screen.prompt.text == ""
        await pilot.press(*"draft", "up")
        assert screen.prompt.text == "first\nline"
        await pilot.press("down", "down")
        assert screen.prompt.text == "draft"
        # an empty prompt sends nothing
        await pilot.press("ctrl+a", "ctrl+k", "enter")
        assert len(client.requests) == 1


@pytest.mark.asyncio
async def test_streaming_updates_are_coalesced(isolated_dirs, monkeypatch):
    """500 deltas in about a second reach the widget as a handful of updates, not 500."""
    client = ScriptedClient("x" * 1500, delay=0.002)
    app = make_app(isolated_dirs, client)
    posted = []
    original = ChatView.AnswerDelta.__init__

    def counting(self, box, text):
        posted.append(text)
        original(self, box, text)

    monkeypatch.setattr(ChatView.AnswerDelta, "__init__", counting)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.chat_screen
        await until(pilot, lambda: app.client is not None)
        screen.prompt.set_text("go")
        await pilot.press("enter")
        await until(pilot, lambda: screen.turn is not None and len(screen.turn.text) >= 300)
        live = screen.chat.boxes()[-1]
        assert live.text == screen.turn.text and not live.has_class("-interrupted")  # shown as in progress
        await until(
            pilot,
            lambda: (
                len(app.store.messages(screen.conv.id)) == 2
                and app.store.messages(screen.conv.id)[1].status == "complete"
            ),
        )
        assert "".join(posted) == "x" * 1500
        assert len(posted) <= 20
        assert screen.chat.boxes()[-1].text == "x" * 1500


@pytest.mark.asyncio
async def test_long_conversation_opens_paged(isolated_dirs):
    app = make_app(isolated_dirs)
    c = app.store.create_conversation(title="Long")
    app.store.db.execute("BEGIN")
    for i in range(3000):
        app.store.add_message(c.id, "user" if i % 2 == 0 else "assistant", f"message {i}")
    app.store.db.execute("COMMIT")
    read = []  # every message the app takes from the store: opening must not read all 3000
    messages = app.store.messages

    def counted(*args, **kwargs):
        got = messages(*args, **kwargs)
        read.extend(got)
        return got

    app.store.messages = counted
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.chat_screen
        await screen.open_conversation(c.id)
        await pilot.pause()
        boxes = screen.chat.boxes()
        assert len(boxes) == PAGE and boxes[-1].text == "message 2999"
        assert len(read) <= PAGE, f"opening read {len(read)} messages"
        screen.query_one("#load-earlier").press()  # scrolled out of view: press it as a user would after scrolling up
        await until(pilot, lambda: "2920 earlier" in str(screen.query_one("#load-earlier").label))
        boxes = screen.chat.boxes()
        assert len(boxes) == 2 * PAGE and boxes[0].text == f"message {3000 - 2 * PAGE}"
        # messages sent since opening do not shift the pages: no duplicates, none skipped
        await screen.turn_part.send("one more")
        await until(pilot, lambda: screen.turn is None and len(screen.chat.boxes()) == 2 * PAGE + 2)
        screen.query_one("#load-earlier").press()
        await until(pilot, lambda: "2880 earlier" in str(screen.query_one("#load-earlier").label))
        texts = [b.text for b in screen.chat.boxes()]
        assert texts[: 3 * PAGE] == [f"message {i}" for i in range(3000 - 3 * PAGE, 3000)]


@pytest.mark.asyncio
async def test_command_palette_runs_actions(isolated_dirs):
    app = make_app(isolated_dirs)
    seed(app.store, 1)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.chat_screen
        await screen.open_conversation(app.store.list_conversations()[0].id)
        await pilot.press("ctrl+p")
        await pilot.press(*"new conv")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: screen.conv is None)
        assert screen.chat.boxes() == []


@pytest.mark.asyncio
async def test_theme_is_remembered(isolated_dirs):
    app = make_app(isolated_dirs)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.chat_screen.turn_part.send("/theme nord")
        await pilot.pause()
        assert app.theme == "nord"
    assert 'theme = "nord"' in isolated_dirs.config_file.read_text()
    app2 = make_app(isolated_dirs)
    async with app2.run_test(size=(80, 24)):
        assert app2.theme == "nord"


@pytest.mark.asyncio
async def test_settings_dialog_validates_and_saves(isolated_dirs):
    app = make_app(isolated_dirs)
    seed(app.store, 1)
    async with app.run_test(size=(80, 40)) as pilot:
        screen = app.chat_screen
        conv = app.store.list_conversations()[0]
        await screen.open_conversation(conv.id)
        await pilot.press("f4")
        await pilot.pause()
        dialog = app.screen
        dialog.query_one("#temperature").value = "-1"
        await pilot.click("#save")
        await pilot.pause()
        assert "temperature" in str(dialog.query_one("#settings-error").render())
        dialog.query_one("#temperature").value = "0.3"
        dialog.query_one("#min_p").value = "1.5"
        dialog.query_one("#save").press()
        await pilot.pause(0.3)
        assert "min-p must be between 0 and 1" in str(dialog.query_one("#settings-error").render())
        dialog.query_one("#min_p").value = "0.1"
        dialog.query_one("#top_k").value = "5"
        dialog.query_one("#seed").value = "42"
        dialog.query_one("#system_prompt").load_text("Be brief.")
        dialog.query_one("#save").press()
        await pilot.pause(0.3)
        assert app.screen is screen, str(dialog.query_one("#settings-error").render())
        saved = app.store.get_conversation(conv.id).settings
        assert (saved["temperature"], saved["min_p"], saved["top_k"]) == (0.3, 0.1, 5)
        assert (saved["seed"], saved["system_prompt"]) == (42, "Be brief.")


@pytest.mark.asyncio
async def test_loop_guard_setting_round_trips(isolated_dirs):
    """[chat] loop_guard = false in config.toml turns the guard off for new conversations; the
    dialog turns it back on per conversation, and the request to the engine carries it."""
    from edgechat.tui.config import build_request

    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nloop_guard = false\n")
    app = make_app(isolated_dirs)
    async with app.run_test(size=(80, 40)) as pilot:
        screen = app.chat_screen
        await pilot.press("f4")
        await pilot.pause()
        assert app.screen.query_one("#loop_guard").value is False
        app.screen.query_one("#loop_guard").value = True
        app.screen.query_one("#save").press()
        await pilot.pause(0.3)
        assert app.screen is screen
        assert build_request(app.store.get_conversation(screen.conv.id).settings, [], session=None).loop_guard is True
    assert build_request({}, [], session=None).loop_guard is True


@pytest.mark.asyncio
async def test_speculative_setting_round_trips(isolated_dirs):
    """[chat] speculative in config.toml is a new conversation's default; the dialog changes it per
    conversation, shows it again, and the request to the engine carries it."""
    from edgechat.tui.config import build_request

    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text('[chat]\nspeculative = "lookup"\n')
    app = make_app(isolated_dirs)
    async with app.run_test(size=(80, 40)) as pilot:
        screen = app.chat_screen
        await pilot.press("f4")
        await pilot.pause()
        assert app.screen.query_one("#speculative").value == "lookup"
        app.screen.query_one("#speculative").value = "off"
        app.screen.query_one("#save").press()
        await pilot.pause(0.3)
        assert app.screen is screen
        conv = screen.conv
        assert app.store.get_conversation(conv.id).settings["speculative"] == "off"
        assert build_request(conv.settings, [], session=conv.id).speculative == "off"
        await pilot.press("f4")
        await pilot.pause()
        assert app.screen.query_one("#speculative").value == "off"


#: user text that Textual markup would swallow ([bold]), or refuse to render at all ([/] closes nothing)
MARKUP = "a [/] b [bold]x[/bold] [red"


@pytest.mark.asyncio
async def test_titles_names_and_errors_are_shown_literally(isolated_dirs):
    client = ScriptedClient("ok")
    app = make_app(isolated_dirs, client)
    conv = app.store.create_conversation(title=MARKUP, model=MARKUP)
    app.store.add_message(conv.id, "user", MARKUP)
    app.store.add_message(conv.id, "assistant", "half", status="error", meta={"model": MARKUP, "error": MARKUP})
    async with app.run_test(size=(100, 30), notifications=True) as pilot:
        screen = app.chat_screen
        await until(pilot, lambda: app.client is not None)
        await screen.open_conversation(conv.id)
        await pilot.pause()
        assert str(screen.query_one("#conv-title").render()) == MARKUP
        assert str(screen.sidebar.options.get_option_at_index(1).prompt) == MARKUP
        user, answer = screen.chat.boxes()
        assert user.text == MARKUP and str(user.query_one(".body").render()) == MARKUP
        assert str(answer.query_one(".stats").render()).endswith(" · " + MARKUP)
        assert str(answer.query_one(".status-note").render()) == f"(error: {MARKUP})"
        await screen.turn_part.send("/delete")
        await pilot.pause()
        assert str(app.screen.query_one(".dialog-title").render()) == f"Delete “{MARKUP}”?"
        await pilot.press("y")
        await until(pilot, lambda: screen.conv is None)
        await screen.turn_part.send("/undo")
        await pilot.pause(0.2)
        toasts = [str(t.render()) for t in app.screen.query(Toast)]
        assert any(f"Deleted “{MARKUP}”" in t for t in toasts)
        assert any(f"Restored “{MARKUP}”" in t for t in toasts)
        # a typed setting that is not a number is quoted back in the dialog's error line
        await pilot.press("f4")
        await pilot.pause()
        dialog = app.screen
        dialog.query_one("#temperature").value = MARKUP
        dialog.query_one("#save").press()
        await pilot.pause()
        assert MARKUP in str(dialog.query_one("#settings-error").render())


def _table_rows(markdown: str) -> list[list[list[str]]]:
    """Each table of `markdown` as rows of cell texts, parsed as the help screen's Markdown widget does."""
    from markdown_it import MarkdownIt

    tables, row, cell = [], None, None
    for token in MarkdownIt("gfm-like").parse(markdown):
        if token.type == "table_open":
            tables.append([])
        elif token.type == "tr_open":
            row = []
            tables[-1].append(row)
        elif token.type in ("th_open", "td_open"):
            cell = ""
        elif token.type == "inline" and cell is not None:
            cell = token.content
        elif token.type in ("th_close", "td_close"):
            row.append(cell)
            cell = None
    return tables


def test_every_help_table_row_parses_into_its_cells():
    """A | in a cell (/export [json|PATH]) must not end the cell: every row has the header's
    number of cells, and the action rows say what the action table says."""
    import re

    from edgechat.tui.actions import ACTIONS, key_label
    from edgechat.tui.screens.help import help_markdown

    text = help_markdown()
    tables = _table_rows(text)
    assert len(tables) == 2
    # in the source too: each line of a table splits on its unescaped | into the header's cells
    # (the parser drops the cells past the header's count without a word)
    for block in re.findall(r"(?:^\|.*\n)+", text, re.MULTILINE):
        counts = {len(re.split(r"(?<!\\)\|", line.strip())) for line in block.splitlines()}
        assert len(counts) == 1, block
    actions = tables[0]
    assert actions[0] == ["Action", "Key", "Slash"]
    for a, row in zip(ACTIONS, actions[1:], strict=True):
        slash = f"`{a.slash}{' ' + a.arg if a.arg else ''}`" if a.slash else ""
        assert row == [a.title, key_label(a.key), slash]
    export = next(row for row in actions if row[0] == "Export conversation")
    assert export[2] == "`/export [json|PATH]`"
    assert all(len(row) == 2 for row in tables[1])


LONG_NAME = "Smollm2 135M 8k Lc100K Mix1 Ep2"


@pytest.mark.asyncio
@pytest.mark.parametrize("width", [100, 80, 50])
async def test_status_bar_parts_are_whole_or_left_out(isolated_dirs, width):
    """Every figure shown is shown whole (no "│ mem" without its number), the line fits, the
    speculative share is said in words, and the name gives way before the last answer's figures."""
    import re

    app = make_app(isolated_dirs)
    async with app.run_test(size=(width, 30)) as pilot:
        await until(pilot, lambda: app.client is not None)
        bar = app.chat_screen.status
        bar.model, bar.backend, bar.context_size, bar.context_used = LONG_NAME, "CPU", 4096, 150
        bar.model_memory = 180 << 20
        if width >= 80:  # before an answer's figures: the model's memory has room beside its name
            await pilot.pause()
            assert bar.render().plain.startswith(LONG_NAME + " │ model 180 MB │ "), bar.render().plain
        bar.ttft, bar.tok_s, bar.spec = 0.12, 25.3, 27.0
        for state in ("ready", "generating"):
            bar.state = state
            await pilot.pause()
            line = bar.render()
            assert line.cell_len <= bar.content_size.width, line.plain
            name, *parts = line.plain.split(" │ ")
            whole = r"CPU|model 180 MB|(ctx )?[█░]+( 150/4096)?|TTFT 0\.12s|25\.3 tok/s|guessed 27%|mem 200 MB"
            assert all(re.fullmatch(whole, p) for p in parts), line.plain
            assert "spec" not in line.plain
            assert "25.3 tok/s" in parts
            assert LONG_NAME.startswith(name.removesuffix(" (generating)").rstrip("…"))
            if state == "ready":
                assert "guessed 27%" in parts
            if state == "ready" and width == 100:  # room for nearly everything: the least useful went
                assert line.plain.startswith(LONG_NAME + " │ ctx ")
                assert line.plain.endswith(" 150/4096 │ TTFT 0.12s │ 25.3 tok/s │ guessed 27%"), line.plain


@pytest.mark.asyncio
async def test_footer_shows_the_main_keys_except_on_a_phone(isolated_dirs):
    from textual.widgets import Footer

    app = make_app(isolated_dirs)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.client is not None)
        footer = app.chat_screen.query_one(Footer)
        await until(pilot, lambda: len(footer.query("FooterKey")) >= 7)  # composed once the bindings are known
        assert footer.region.height == 1 and footer.region.y == 23
        shown = {(k.key_display, k.description) for k in footer.query("FooterKey")}
        for key in [("^n", "New"), ("esc", "Stop"), ("^f", "Search"), ("^o", "Model"), ("f1", "Help"), ("^q", "Quit")]:
            assert key in shown, shown
        # the keys shown fit the line: none cut off at the right
        keys = [k for k in footer.query("FooterKey") if "-command-palette" not in k.classes]
        assert max(k.region.right for k in keys) <= 80
        # the status bar stays whole above it
        assert app.chat_screen.status.region.y == 22
        await pilot.resize_terminal(50, 30)
        await until(pilot, lambda: footer.region.height == 0)
        assert app.chat_screen.status.region.y == 29


@pytest.mark.asyncio
async def test_sidebar_lists_one_line_per_title_under_day_headings(isolated_dirs):
    from edgechat.tui.widgets.sidebar import day_label

    app = make_app(isolated_dirs)
    now = time.time()
    long = app.store.create_conversation(title="A very long conversation title that would wrap over two lines")
    old = app.store.create_conversation(title="Older chat")
    older = app.store.create_conversation(title="Much older chat")
    for conv, age in ((old, 86400), (older, 30 * 86400)):
        app.store.db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now - age, conv.id))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.1)
        options = app.chat_screen.sidebar.options
        prompts = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert prompts == [
            "Today", long.title, "Yesterday", "Older chat", day_label(now - 30 * 86400), "Much older chat"
        ]
        headings = [options.get_option_at_index(i) for i in (0, 2, 4)]
        assert all(h.disabled for h in headings)
        # one screen line per entry: the long title ends in … instead of wrapping
        assert options.virtual_size.height == options.option_count
        line = options.render_line(1).text
        assert line.rstrip().endswith("…") and line.startswith("A very long")
    assert day_label(now, now) == "Today" and day_label(now - 86400, now) == "Yesterday"
    assert day_label(now - 3 * 86400, now) == time.strftime("%A", time.localtime(now - 3 * 86400))


# -- snapshots (look at the SVGs in tests/__snapshots__ before accepting changes) -----------


def _open_first(app):
    async def run_before(pilot):
        screen = app.chat_screen
        await screen.open_conversation(app.store.list_conversations()[0].id)
        await pilot.pause(0.2)

    return run_before


@pytest.mark.parametrize("size", [(80, 24), (50, 30)])
def test_snapshot_chat(snap_compare, isolated_dirs, size):
    app = make_app(isolated_dirs)
    seed(app.store)
    assert snap_compare(app, terminal_size=size, run_before=_open_first(app))


@pytest.mark.parametrize("size", [(80, 24), (50, 30)])
def test_snapshot_help(snap_compare, isolated_dirs, size):
    assert snap_compare(make_app(isolated_dirs), terminal_size=size, press=["f1", "_"])


@pytest.mark.parametrize("size", [(80, 24), (50, 30)])
def test_snapshot_settings(snap_compare, isolated_dirs, size):
    assert snap_compare(make_app(isolated_dirs), terminal_size=size, press=["f4", "_"])


def test_snapshot_narrow_sidebar_open(snap_compare, isolated_dirs):
    app = make_app(isolated_dirs)
    seed(app.store)
    assert snap_compare(app, terminal_size=(50, 30), press=["ctrl+b", "_"])


@pytest.mark.asyncio
async def test_copy_answer_and_code_block(isolated_dirs):
    app = make_app(isolated_dirs)
    seed(app.store, 1)
    copied = []
    app.copy_to_clipboard = copied.append  # what would go to the terminal as OSC 52
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.chat_screen
        await screen.open_conversation(app.store.list_conversations()[0].id)
        await screen.turn_part.send("/copy")
        assert copied[-1] == ANSWER
        assert (isolated_dirs.data / "clipboard.txt").read_text() == ANSWER
        await screen.turn_part.send("/copycode")
        assert copied[-1] == "print('hello')\n"
        screen.chat.boxes()[0].focus()
        await pilot.press("c")
        assert copied[-1] == "How do I print in Python?"


@pytest.mark.asyncio
async def test_model_picker_lists_embedded_models_and_loads_the_pick(isolated_dirs):
    asked = []
    client = ScriptedClient()

    def factory(ref):
        asked.append(ref)
        return client

    app = EdgechatApp(isolated_dirs, client_factory=factory)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.client is not None)
        await pilot.press("ctrl+o")
        picker = app.screen
        listing = picker.query_one("#model-list")
        await until(pilot, lambda: listing.option_count >= 2 and listing.get_option_at_index(0).id is not None)
        first = str(listing.get_option_at_index(0).prompt)
        assert "smollm2-135m-instruct" in first and "Q4_1" in first and "fits" in first
        assert "gemma3-270m" in str(listing.get_option_at_index(1).prompt)
        # then the catalog, with what picking one costs
        catalog_rows = [str(listing.get_option_at_index(i).prompt) for i in range(2, listing.option_count)]
        assert any(r.startswith("smollm2-360m-instruct") and "not downloaded" in r and "~258 MiB" in r for r in catalog_rows)
        listing.focus()
        listing.highlighted = 0
        await pilot.press("enter")
        await until(pilot, lambda: len(asked) == 2)
        assert asked[-1] == "smollm2-135m-instruct"


@pytest.mark.asyncio
async def test_stats_on_demand(isolated_dirs):
    app = make_app(isolated_dirs)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        await until(pilot, lambda: app.client is not None)
        await screen.turn_part.send("hi")
        await until(pilot, lambda: screen.turn is None and len(screen.chat.boxes()) == 2)
        stats = screen.chat.boxes()[-1].query_one(".stats")
        assert "TTFT 0.05s" in str(stats.render()) and not stats.display
        await pilot.press("ctrl+t")
        assert stats.display
        assert "TTFT 0.05s" in str(screen.status.render())


def test_slash_parsing():
    from edgechat.tui.actions import parse_slash, unknown_slash

    action, arg = parse_slash("/model  gemma3 ")
    assert (action.name, arg) == ("model", "gemma3")
    assert parse_slash("/MODEL")[0].name == "model"
    assert parse_slash("hello /model") is None
    assert unknown_slash("/frobnicate now") == "/frobnicate"
    assert unknown_slash("/usr/bin/env is a path") is None
    assert unknown_slash("/new") is None


@pytest.mark.asyncio
async def test_unknown_slash_command_is_not_sent(isolated_dirs):
    client = ScriptedClient("ok")
    app = make_app(isolated_dirs, client)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.client is not None)
        await app.chat_screen.turn_part.send("/frobnicate")
        await pilot.pause()
        assert client.requests == [] and app.store.list_conversations() == []
        assert any("Unknown command /frobnicate" in n.message for n in app._notifications)


@pytest.mark.asyncio
async def test_waiting_message_comes_back_when_the_model_fails(isolated_dirs):
    import threading

    from edgechat.errors import ModelNotFoundError

    gate = threading.Event()

    def failing(ref):
        gate.wait(10)
        raise ModelNotFoundError("unknown model 'nope'; see: edgechat models")

    app = EdgechatApp(isolated_dirs, client_factory=failing)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.chat_screen
        await pilot.press(*"hi there", "enter")
        await pilot.pause(0.1)
        assert screen.turn_part.waiting is not None
        gate.set()
        await until(pilot, lambda: screen.turn_part.waiting is None)
        await pilot.pause(0.05)
        assert screen.prompt.text == "hi there" and app.store.messages(screen.conv.id) == []
        assert screen.status.state == "no model"
        assert any("unknown model 'nope'" in n.message for n in app._notifications)


@pytest.mark.asyncio
async def test_draft_survives_a_restart(isolated_dirs):
    app = make_app(isolated_dirs)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press(*"half-typed thought", "ctrl+j", *"second line")
        await pilot.pause(0.7)
        # saved while typing, not only on quit (a killed process keeps it too)
        assert (isolated_dirs.data / "draft.txt").read_text() == "half-typed thought\nsecond line"
    app2 = make_app(isolated_dirs)
    async with app2.run_test(size=(80, 24)) as pilot:
        screen = app2.chat_screen
        assert screen.prompt.text == "half-typed thought\nsecond line"
        await until(pilot, lambda: app2.client is not None)
        await pilot.press("enter")
        await until(pilot, lambda: screen.turn is None and len(screen.chat.boxes()) == 2)
        await pilot.pause(0.7)
        assert not (isolated_dirs.data / "draft.txt").exists()


def test_update_pacing_follows_the_ui_cost(monkeypatch):
    """Updates that cost the UI thread more CPU come less often: its share stays under UI_SHARE."""
    from edgechat.tui.widgets import chatview

    view = ChatView()
    clock = iter([10.0, 10.004, 10.104, 10.114])  # UI thread CPU time at four updates
    monkeypatch.setattr(chatview.time, "thread_time", lambda: next(clock))
    view._pace()
    assert view._interval == chatview.FLUSH_INTERVAL
    view._pace()  # 4 ms since the last update: cheap, the base interval
    assert view._interval == chatview.FLUSH_INTERVAL
    view._pace()  # 100 ms: stretched, capped so text still moves every MAX_INTERVAL
    assert view._interval == chatview.MAX_INTERVAL
    view._pace()  # 10 ms: 0.010 / UI_SHARE
    assert view._interval == pytest.approx(0.010 / chatview.UI_SHARE)


@pytest.mark.parametrize("line", ['speculative = "fast"', 'context_policy = "drop"', 'temperature = -1'])
def test_a_bad_chat_setting_in_config_toml_is_one_line_naming_the_file(isolated_dirs, line):
    from edgechat.tui.config import load_config

    isolated_dirs.config_file.parent.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text(f"[chat]\n{line}\n")
    with pytest.raises(UsageError, match=r"config\.toml: \[chat\] .*fix or remove that line"):
        load_config(isolated_dirs)


def test_idle_unload_in_config_toml(isolated_dirs):
    """[tui] idle_unload: seconds, false for never, 600 unset; anything else one line naming the file."""
    from edgechat.tui.config import load_config

    isolated_dirs.config_file.parent.mkdir(parents=True, exist_ok=True)
    assert load_config(isolated_dirs).idle_unload == 600
    for value, seconds in (("30", 30.0), ("0.5", 0.5), ("false", None)):
        isolated_dirs.config_file.write_text(f"[tui]\nidle_unload = {value}\n")
        assert load_config(isolated_dirs).idle_unload == seconds
    for value in ('"soon"', "-1", "true"):
        isolated_dirs.config_file.write_text(f"[tui]\nidle_unload = {value}\n")
        with pytest.raises(UsageError, match=r"config\.toml: \[tui\] idle_unload must be a number of seconds"):
            load_config(isolated_dirs)
