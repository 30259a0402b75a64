"""The chat app and a reasoning model (issue 25): thoughts stream in a dimmed block above the
answer, fold to one line when the answer starts, expand on F3, t or a click, are stored apart,
survive a restart and an export, and the conversation's setting switches them off.

On the real SmolLM2, given the Qwen3-style thinking template of tests/test_reasoning.py: its
generation prompt opens `<think>`, so what SmolLM2 writes first is its thoughts; a small budget
closes them and an answer follows."""

from __future__ import annotations

import json
import re

import pytest
from serving import serving
from textual.widgets import Static

from edgechat.engine import ChatRequest
from edgechat.errors import UsageError
from edgechat.tui.app import EdgechatApp
from edgechat.tui.client import LocalClient, RemoteClient
from edgechat.tui.config import build_request, load_config
from edgechat.tui.widgets.chatview import Thoughts
from tests.test_reasoning import THINK_TEMPLATE
from tests.test_tui_flows import ready, send, until
from tests.test_tui_remote import openai_double

pytestmark = pytest.mark.slow

SIZES = [(80, 24), (50, 30)]
ASK = "Explain in detail how photosynthesis works."
SUMMARY = re.compile(r"^▸ thought for [\d.]+ s, \d+ tokens$")


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_path):
    from edgechat.config import get_paths

    c = LocalClient(str(smollm2_path), get_paths(tmp_path_factory.mktemp("think-engine")),
                    engine_options={"chat_template": THINK_TEMPLATE})
    yield c
    c.close()


@pytest.fixture
def paths(isolated_dirs):
    # greedy, short, and a budget of 8 tokens: the thoughts end and an answer follows
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 32\ntemperature = 0.0\nseed = 7\nthinking = 8\n")
    return isolated_dirs


def app_for(paths, client) -> EdgechatApp:
    return EdgechatApp(paths, client_factory=lambda ref: client)


def line(thoughts: Thoughts) -> str:
    return str(thoughts.query_one(".thoughts-line", Static).render())


def shown(widget) -> bool:
    """On screen: displayed, it and every container above it."""
    return widget.display and all(w.display for w in widget.ancestors_with_self if hasattr(w, "display")) \
        and widget.region.width > 0


def record_updates(monkeypatch, screen) -> list[tuple]:
    """What the block and the status bar showed at each update of the thoughts, however fast
    the machine (the worker may deliver 8 tokens of thoughts in one update)."""
    seen = []
    append = Thoughts.append

    def spy(self, text):
        append(self, text)
        box = next(b for b in screen.chat.boxes() if b.thoughts is self)
        seen.append((self.thinking, self.expanded, line(self), self.text, box.text, screen.status.state))

    monkeypatch.setattr(Thoughts, "append", spy)
    return seen


@pytest.mark.asyncio
@pytest.mark.parametrize("size", SIZES)
async def test_thoughts_stream_fold_when_the_answer_starts_and_expand(paths, client, monkeypatch, size):
    app = app_for(paths, client)
    sent: list[ChatRequest] = []
    submit = client.submit
    monkeypatch.setattr(client, "submit", lambda request: sent.append(request) or submit(request))
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        seen = record_updates(monkeypatch, screen)
        await send(pilot, ASK)
        answer = app.store.messages(screen.conv.id)[-1]
        assert answer.reasoning.strip() and answer.content.strip()
        assert "think>" not in answer.content + answer.reasoning
        assert sent[0].reasoning_budget == 8
        # streamed: shown whole, headed "thinking…", the status bar thinking, before any answer
        assert seen and all(s[:3] == (True, True, "▾ thinking…") and s[4] == "" and s[5] == "thinking…" for s in seen)
        assert seen[-1][3] == answer.reasoning
        # then one line, with the engine's count of the thoughts' tokens
        box = screen.chat.boxes()[-1]
        thoughts = box.thoughts
        assert SUMMARY.match(line(thoughts)), line(thoughts)
        assert f", {answer.meta['reasoning_tokens']} tokens" in line(thoughts)
        text = thoughts.query_one(".thoughts-text", Static)
        assert shown(thoughts) and not shown(text) and thoughts.region.height == 1
        assert thoughts.region.y < box.query_one(".body").region.y  # above the answer
        assert box.text == answer.content and screen.status.state == "ready"
        # F3 expands the last answer's thoughts, wrapped to the width (at 50 columns too)
        await pilot.press("f3")
        await pilot.pause()
        assert thoughts.expanded and shown(text) and line(thoughts).startswith("▾ thought for")
        assert text.region.right <= size[0] and str(text.render()) == answer.reasoning
        assert text.region.height >= -(-len(answer.reasoning) // size[0])
        # a click on the line folds them again; t on the focused message unfolds them
        head = thoughts.query_one(".thoughts-line")
        screen.chat.scroll_to_widget(head, animate=False, top=True)
        await pilot.pause()
        await pilot.click(head)
        await pilot.pause()
        assert not thoughts.expanded and not shown(text)
        box.focus()
        await pilot.press("t")
        await pilot.pause()
        assert thoughts.expanded and shown(text)
        # the next turn's history has the answer, never its thoughts
        await send(pilot, "And in one sentence?")
        earlier = [m for m in sent[1].messages if m["role"] == "assistant"]
        assert earlier == [{"role": "assistant", "content": answer.content}]


@pytest.mark.asyncio
async def test_thoughts_survive_a_restart_and_an_export(paths, client):
    app = app_for(paths, client)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await send(pilot, ASK)
        conv_id = app.chat_screen.conv.id
        summary = line(app.chat_screen.chat.boxes()[-1].thoughts)
    answer = app.store.messages(conv_id)[-1]
    assert answer.reasoning.strip()

    again = app_for(paths, client)  # a new app on the same data dir
    async with again.run_test(size=(50, 30)) as pilot:
        await ready(pilot)
        screen = again.chat_screen
        await screen.open_conversation(conv_id)
        await pilot.pause()
        box = screen.chat.boxes()[-1]
        assert line(box.thoughts) == summary and not box.thoughts.expanded
        assert box.thoughts.text == answer.reasoning and box.text == answer.content
        await pilot.press("f3")
        await pilot.pause()
        assert shown(box.thoughts.query_one(".thoughts-text"))
        md, js = again.paths.data / "chat.md", again.paths.data / "chat.json"
        screen.action_export(str(md))
        screen.action_export(str(js))
    markdown = md.read_text()
    quoted = "\n".join(f"> {ln}".rstrip() for ln in answer.reasoning.strip().splitlines())
    assert f"> **Thoughts**\n>\n{quoted}\n\n{answer.content.strip()}" in markdown
    assert markdown.index("## Assistant") < markdown.index("> **Thoughts**")
    data = json.loads(js.read_text())
    assert data["messages"][-1]["reasoning"] == answer.reasoning
    assert data["messages"][-1]["content"] == answer.content and "reasoning" not in data["messages"][0]


@pytest.mark.asyncio
@pytest.mark.parametrize("size", SIZES)
async def test_the_setting_switches_thinking_off(paths, client, monkeypatch, size):
    app = app_for(paths, client)
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        seen = record_updates(monkeypatch, screen)
        await pilot.press("f4")
        await pilot.pause()
        dialog = app.screen
        assert dialog.query_one("#thinking").value == "8"  # the [chat] default from config.toml
        dialog.query_one("#thinking").value = "lots"
        dialog.query_one("#save").press()
        await pilot.pause(0.2)
        assert "thinking must be on, off or a number" in str(dialog.query_one("#settings-error").render())
        dialog.query_one("#thinking").value = "off"
        dialog.query_one("#save").press()
        await pilot.pause(0.2)
        assert app.screen is screen and screen.conv.settings["thinking"] == "off"
        await send(pilot, ASK)
        answer = app.store.messages(screen.conv.id)[-1]
        assert answer.content.strip() and answer.reasoning == "" and "reasoning_tokens" not in answer.meta
        box = screen.chat.boxes()[-1]
        assert seen == [] and box.thoughts.text == "" and not shown(box.thoughts)


def test_thinking_setting_maps_to_the_reasoning_budget(paths):
    history = [{"role": "user", "content": "hi"}]
    assert load_config(paths).chat["thinking"] == 8
    budgets = {v: build_request({"thinking": v}, history, None).reasoning_budget for v in ("on", "off", 8, "12", 0)}
    assert budgets == {"on": None, "off": 0, 8: 8, "12": 12, 0: 0}
    assert build_request({}, history, None).reasoning_budget is None  # thinking as long as the model likes
    paths.config_file.write_text('[chat]\nthinking = "lots"\n')
    with pytest.raises(UsageError, match=r"\[chat\] thinking must be on, off or a number"):
        load_config(paths)


def thought(text: str, key: str = "reasoning_content") -> dict:
    return {"choices": [{"index": 0, "delta": {key: text}, "finish_reason": None}]}


@pytest.mark.asyncio
async def test_remote_mode_reads_reasoning_content_and_reasoning_deltas(paths):
    bodies: list[dict] = []
    events = [thought("Plants use "), thought("light.", "reasoning"),
              {"choices": [{"index": 0, "delta": {"content": "Sunlight."}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6,
                                        "completion_tokens_details": {"reasoning_tokens": 4}}},
              "[DONE]"]
    with serving(openai_double(events, bodies)) as url:
        app = EdgechatApp(paths, url=url)
        async with app.run_test(size=(50, 30)) as pilot:
            await until(pilot, lambda: app.client is not None, what="the server")
            screen = app.chat_screen
            await send(pilot, ASK)
            answer = app.store.messages(screen.conv.id)[-1]
            assert (answer.reasoning, answer.content, answer.meta["reasoning_tokens"]) == ("Plants use light.", "Sunlight.", 4)
            thoughts = screen.chat.boxes()[-1].thoughts
            assert SUMMARY.match(line(thoughts)) and line(thoughts).endswith(", 4 tokens")
            # the budget goes to the server; off also sends the template's switch
            assert bodies[0]["reasoning_budget"] == 8 and "chat_template_kwargs" not in bodies[0]
            client = app.client
            off = client.body(build_request({"thinking": "off"}, [{"role": "user", "content": "hi"}], None))
            assert off["reasoning_budget"] == 0 and off["chat_template_kwargs"] == {"enable_thinking": False}
            assert "reasoning_budget" not in client.body(build_request({}, [{"role": "user", "content": "hi"}], None))
    assert isinstance(client, RemoteClient)
