"""The chat app's real flows, driven with Textual's Pilot, on the real embedded SmolLM2 model."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from edgechat.tui.app import EdgechatApp
from edgechat.tui.client import LocalClient
from edgechat.tui.screens.help import HelpScreen
from edgechat.tui.widgets.chatview import MessageBox

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_path):
    """One engine for the module's apps (loading a model per test would dominate the run time)."""
    from edgechat.config import get_paths

    c = LocalClient(str(smollm2_path), get_paths(tmp_path_factory.mktemp("tui-engine")))
    yield c
    c.close()


@pytest.fixture
def paths(isolated_dirs):
    # Short greedy answers: the flows, not the prose, are under test.
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 12\ntemperature = 0.0\nseed = 7\n")
    return isolated_dirs


async def until(pilot, condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def ready(pilot) -> None:
    await until(pilot, lambda: pilot.app.client is not None, what="the model")


async def send(pilot, text: str) -> None:
    screen = pilot.app.chat_screen
    screen.prompt.set_text(text)
    screen.prompt.focus()
    await pilot.press("enter")
    await until(pilot, lambda: screen.turn is None and screen.turn_part.waiting is None, what="the answer")
    await pilot.pause(0.05)


#: greedy SmolLM2 answers this with a phrase repeated until max_tokens: an answer still running when a test stops it
LOOPING = "What is the capital of France?"


def app_for(paths, client) -> EdgechatApp:
    return EdgechatApp(paths, client_factory=lambda ref: client)


def stored(app):
    conv = app.chat_screen.conv
    return [(m.role, m.content, m.status) for m in app.store.messages(conv.id)]


async def test_send_streams_and_stores_the_answer(paths, client):
    app = app_for(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await send(pilot, "What is the capital of France?")
        msgs = app.store.messages(screen.conv.id)
        assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "complete")]
        answer = msgs[1]
        assert answer.content.strip()
        assert answer.meta["finish_reason"] in ("stop", "length")
        assert answer.meta["completion_tokens"] > 0 and answer.meta["ttft"] > 0
        boxes = screen.chat.boxes()
        assert [b.text for b in boxes] == [m.content for m in msgs]
        # titled from the first message, listed in the sidebar, gauge filled from the engine's metrics
        assert screen.conv.title == "What is the capital of France?"
        assert [str(o.prompt) for o in screen.sidebar.options.options] == ["Today", "What is the capital of France?"]
        assert 0 < screen.status.context_used <= screen.status.context_size == client.n_ctx
        # the next turn reuses the conversation's KV: the whole previous exchange comes from cache
        await send(pilot, "And of Spain?")
        second = app.store.messages(screen.conv.id)[-1]
        assert second.meta["cached_tokens"] > 0
        assert len(screen.chat.boxes()) == 4


async def start_long_answer(app, pilot):
    """Open a conversation allowing a 3,000-token answer, send a prompt that loops, wait for text."""
    await ready(pilot)
    screen = app.chat_screen
    long = app.store.create_conversation(settings={**app.config.chat, "max_tokens": 3000, "loop_guard": False})
    await screen.open_conversation(long.id)
    screen.prompt.set_text(LOOPING)
    await pilot.press("enter")
    await until(pilot, lambda: screen.turn is not None and len(screen.turn.text) > 5, what="some text")
    return screen


async def test_stop_keeps_partial_answer_and_restores_prompt(paths, client):
    app = app_for(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await start_long_answer(app, pilot)
        await pilot.press("escape")
        await until(pilot, lambda: screen.turn is None, what="the stop")
        await pilot.pause(0.05)
        (role_u, _, _), (role_a, content, status) = stored(app)
        assert (role_u, role_a, status) == ("user", "assistant", "interrupted")
        assert content.strip()
        assert screen.chat.boxes()[-1].has_class("-interrupted")
        assert screen.prompt.text == LOOPING


async def test_stop_before_the_first_token_undoes_the_send(paths, client):
    """Esc before any text came back: nothing is stored, the message goes back into the input."""
    from edgechat.engine import ChatRequest, RequestStatus

    # Another request holds the engine's one decoding slot: the app's request waits in the queue,
    # so the stop lands before its first token however fast the machine is.
    blocker = client.submit(
        ChatRequest(messages=[{"role": "user", "content": LOOPING}], max_tokens=3000, ignore_eos=True)
    )
    try:
        app = app_for(paths, client)
        async with app.run_test(size=(100, 30)) as pilot:
            await ready(pilot)
            screen = app.chat_screen
            screen.prompt.set_text("hello there")  # (each key waits for an idle app, slow beside a busy engine)
            await pilot.press("enter")
            await until(pilot, lambda: client.engine.stats()["waiting"] == 1, what="the request to queue")
            await pilot.press("escape")
            await until(pilot, lambda: screen.turn is None, what="the stop")
            await pilot.pause(0.05)
            assert blocker.status == RequestStatus.RUNNING  # still holding the slot: no token came first
            assert app.store.messages(screen.conv.id) == [] and screen.chat.boxes() == []
            assert screen.prompt.text == "hello there"
            assert client.engine.stats()["waiting"] == 0
            # once the engine is free, the message put back is answered
            blocker.cancel()
            await send(pilot, screen.prompt.text)
            statuses = [(role, status) for role, _, status in stored(app)]
            assert statuses == [("user", "complete"), ("assistant", "complete")]
    finally:
        blocker.cancel()


async def test_regenerate_edit_and_resend(paths, client):
    app = app_for(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await send(pilot, "Name a color.")
        first_answer = app.store.messages(screen.conv.id)[-1]
        await pilot.press("ctrl+r")
        await until(pilot, lambda: screen.turn is None and len(app.store.messages(screen.conv.id)) == 2)
        await until(pilot, lambda: app.store.messages(screen.conv.id)[-1].status == "complete", what="regenerated")
        msgs = app.store.messages(screen.conv.id)
        assert [m.role for m in msgs] == ["user", "assistant"]
        assert msgs[1].id != first_answer.id and msgs[1].content.strip()
        # edit the last user message and resend: everything from it is replaced
        await pilot.press("ctrl+g")
        assert screen.prompt.text == "Name a color."
        await send(pilot, "Name an animal.")
        msgs = app.store.messages(screen.conv.id)
        assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "complete")]
        assert msgs[0].content == "Name an animal."
        assert [b.message.id for b in screen.chat.boxes()] == [m.id for m in msgs]


async def test_branch_search_and_open_hit(paths, client):
    app = app_for(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await send(pilot, "Tell me about zebras.")
        await send(pilot, "Where do they live?")
        original = screen.conv
        # branch at the first answer, by focusing its box and pressing b
        boxes = screen.chat.boxes()
        boxes[1].focus()
        await pilot.press("b")
        await pilot.pause(0.1)
        branch = screen.conv
        assert branch.id != original.id and branch.parent_id == original.id
        assert [m.content for m in app.store.messages(branch.id)] == [b.text for b in boxes[:2]]
        assert len(screen.chat.boxes()) == 2
        # full-text search from the sidebar; Enter in the search box opens the first hit, in the
        # original conversation, with its message in view
        await pilot.press("ctrl+f")
        await pilot.press(*"live")
        await pilot.pause(0.1)
        options = screen.sidebar.options
        assert options.option_count == 1 and "[live]" in str(options.get_option_at_index(0).prompt)
        assert screen.focused is screen.query_one("#search")
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert screen.conv.id == original.id
        assert isinstance(screen.focused, MessageBox) and screen.focused.text == "Where do they live?"
        # with several hits, Enter in the box opens the one highlighted
        await pilot.press("ctrl+f", *"zebras")
        await pilot.pause(0.1)
        assert options.option_count >= 2 and options.highlighted == 0  # the question, in both conversations
        _, conv_id, msg_id = options.get_option_at_index(1).id.split(":")
        options.highlighted = 1
        screen.query_one("#search").focus()
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert screen.conv.id == conv_id and screen.focused.message.id == int(msg_id)


async def test_slash_commands_export_and_persistence(paths, client):
    app = app_for(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await send(pilot, "/system You answer in one word.")
        assert screen.conv.settings["system_prompt"] == "You answer in one word."
        await send(pilot, "Say hello.")
        conv_id = screen.conv.id
        await send(pilot, "/rename Greetings")
        assert app.store.get_conversation(conv_id).title == "Greetings"
        await send(pilot, "/export")
        await send(pilot, "/export json")
        exports = sorted((paths.data / "exports").iterdir())
        assert [p.suffix for p in exports] == [".json", ".md"]
        data = json.loads(exports[0].read_text())
        assert data["settings"]["system_prompt"] == "You answer in one word."
        assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
        assert "## You\n\nSay hello." in exports[1].read_text()
        await send(pilot, "/help")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await send(pilot, "/new")
        assert screen.conv is None and screen.chat.boxes() == []
        await send(pilot, "/search hello")
        assert screen.sidebar.options.option_count >= 1
        await pilot.press("escape")
        # delete asks first, /undo brings it back
        await screen.open_conversation(conv_id)
        await send(pilot, "/delete")
        await pilot.press("y")
        await pilot.pause(0.1)
        assert app.store.get_conversation(conv_id) is None
        await send(pilot, "/undo")
        assert [m.role for m in app.store.messages(conv_id)] == ["user", "assistant"]
        await send(pilot, "/clear")
        await pilot.press("y")
        await pilot.pause(0.1)
        assert app.store.messages(conv_id) == [] and screen.chat.boxes() == []
    # quit and reopen: the conversation is still there
    app2 = app_for(paths, client)
    async with app2.run_test(size=(100, 30)) as pilot:
        titles = [str(o.prompt) for o in app2.chat_screen.sidebar.options._options]
        assert "Greetings" in titles


async def test_quit_mid_answer_keeps_it_interrupted(paths, client):
    app = app_for(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = await start_long_answer(app, pilot)
        conv_id = screen.conv.id
        await pilot.press("ctrl+q")
    msgs = app.store.messages(conv_id)
    assert msgs[-1].role == "assistant" and msgs[-1].status == "interrupted" and msgs[-1].content.strip()


async def test_switch_model_and_a_model_that_does_not_fit(paths, gemma3_path, smollm2_path, tmp_path, monkeypatch):
    app = EdgechatApp(paths)  # its own clients, loaded by the app in the background
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        assert app.client.model_name.lower().startswith("smollm2")
        shown: list[str] = []  # what the status bar said while the model loaded
        show = app._show_load_progress
        monkeypatch.setattr(app, "_show_load_progress", lambda text: (show(text), shown.append(screen.status.state)))
        await send(pilot, f"/model {gemma3_path}")
        await until(pilot, lambda: app.client.model_name.lower().startswith("gemma"), what="gemma3")
        assert len(shown) >= 2 and shown[-1] == f"loading {gemma3_path}… 100%"
        assert all(t.startswith(f"loading {gemma3_path}… ") for t in shown)
        assert screen.status.model == app.client.model_name
        assert any("no chat template" in n.message for n in app._notifications)  # completion-mode warning
        # a machine with 64 MiB free: the planner refuses, the loaded model keeps serving
        from edgechat.models import planner

        monkeypatch.setattr(planner, "available_memory", lambda: 64 << 20)
        loaded = app.client
        # not the SmolLM2 loaded first: that one is still held, and switching to it needs no room
        other = tmp_path / "other.gguf"
        os.link(smollm2_path, other)
        await send(pilot, f"/model {other}")
        await until(pilot, lambda: any("Cannot load" in n.message for n in app._notifications), what="refusal")
        refusal = next(n.message for n in app._notifications if "Cannot load" in n.message)
        assert "free" in refusal and "smaller" in refusal
        assert app.client is loaded
        await send(pilot, "The sea is")
        assert app.store.messages(screen.conv.id)[-1].status == "complete"


async def test_switching_models_twice_quickly_leaves_one_engine(paths, gemma3_path, monkeypatch):
    """A second switch while the first model still loads: the first one, once loaded, is closed."""
    import threading

    from edgechat.tui import client as clients

    made: list[LocalClient] = []
    closed: list[LocalClient] = []
    gemma_loading, switched_back = threading.Event(), threading.Event()

    class Recorded(LocalClient):
        def __init__(self, model, *args, **kwargs):
            if model == str(gemma3_path):
                gemma_loading.set()
                switched_back.wait(30)  # a slow load: the second switch comes while it runs
            super().__init__(model, *args, **kwargs)
            made.append(self)

        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(clients, "LocalClient", Recorded)
    app = EdgechatApp(paths)  # its own clients, loaded by the app in the background
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        first = app.client
        screen = app.chat_screen
        await send(pilot, f"/model {gemma3_path}")
        await until(pilot, gemma_loading.is_set, what="gemma3 to start loading")
        await send(pilot, "/model smollm2-135m-instruct")
        switched_back.set()
        await until(pilot, lambda: app.client is not first and len(made) == 3, what="both loads")
        # the stale load's close starts from its worker's state message, which can come after
        # every worker has stopped running: wait for the outcome itself (a full suite run once
        # asserted in between)
        await until(pilot, lambda: [c for c in made if c not in closed] == [app.client], what="the stale model closed")
        await until(pilot, lambda: not any(w.is_running for w in app.workers if "model" in (w.group or "")))
        assert app.client.model_name.lower().startswith("smollm2") and screen.status.state == "ready"
        assert [c for c in made if c not in closed] == [app.client]
        await send(pilot, "The sea is")
        assert app.store.messages(screen.conv.id)[-1].status == "complete"


async def test_switching_back_to_a_loaded_model_needs_no_load(paths, smollm2_path, gemma3_path):
    """A -> B -> A: A stays loaded beside B, so the switch back takes the same engine, loads
    nothing, and answers as before; the picker marks both loaded, the status bar gives the
    model's memory."""
    from edgechat.tui.screens.models import ModelPickerScreen

    app = EdgechatApp(paths, model=str(smollm2_path))  # its own models, in its own pool
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await send(pilot, "The sea is")
        before = app.store.messages(screen.conv.id)[-1].content
        pool = app.local_models.pool
        small, engine = pool.models[str(smollm2_path)], app.client.engine
        assert small.loads == 1 and screen.status.model_memory == small.need > 0
        await send(pilot, f"/model {gemma3_path}")
        await until(pilot, lambda: app.client.model_name.lower().startswith("gemma"), what="gemma3")
        gemma = pool.models[str(gemma3_path)]
        assert screen.status.model_memory == gemma.need
        assert f"model {gemma.need / 2**20:.0f} MB" in str(screen.status.render())
        await send(pilot, f"/model {smollm2_path}")
        await until(pilot, lambda: app.client.model_name.lower().startswith("smollm2"), what="smollm2 again")
        assert app.client.engine is engine and small.loads == 1 and gemma.loads == 1
        assert {m.name for m in pool.resident()} == {str(smollm2_path), str(gemma3_path)}
        assert screen.status.model_memory == small.need
        await screen.action_new()
        await send(pilot, "The sea is")
        assert app.store.messages(screen.conv.id)[-1].content == before
        screen.action_model()
        await until(pilot, lambda: isinstance(app.screen, ModelPickerScreen) and app.screen._rows, what="the picker")
        marked = [ref for ref, row in app.screen._rows.items() if app.screen._loaded_label(row)]
        assert len(marked) == 2
        shown = [str(app.screen.query_one("#model-list").get_option_at_index(i).prompt)
                 for i in range(app.screen.query_one("#model-list").option_count)]
        assert sum("● loaded" in text for text in shown) == 2


def _rss() -> int:
    """This process's resident memory (bytes), as the kernel counts it."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


async def test_a_model_switched_away_from_unloads_when_idle_never_the_one_in_use(paths, smollm2_path, gemma3_path):
    """[tui] idle_unload: A -> B; A leaves memory after its seconds (RSS falls), B, in use, stays
    loaded however long it sits idle; switching back to A loads it again."""
    from edgechat.engine.pool import ModelState

    idle = 3.0  # long enough that A is still loaded when the switch to B has been seen
    with open(paths.config_file, "a") as fh:
        fh.write(f"[tui]\nidle_unload = {idle}\n")
    app = EdgechatApp(paths, model=str(smollm2_path))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await send(pilot, "The sea is")
        pool = app.local_models.pool
        small = pool.models[str(smollm2_path)]
        assert small.idle_unload == idle and small.unload_at is None  # in use: on no clock
        await send(pilot, f"/model {gemma3_path}")
        await until(pilot, lambda: app.client.model_name.lower().startswith("gemma"), what="gemma3")
        gemma, engine = pool.models[str(gemma3_path)], app.client.engine
        both = _rss()
        assert small.state is ModelState.LOADED and small.unload_at is not None
        await until(pilot, lambda: small.state is ModelState.UNLOADED, timeout=60 + idle, what="smollm2 to unload")
        # its weights (the mapped file) and cache are gone from this process
        assert both - _rss() > smollm2_path.stat().st_size // 2, (both, _rss())

        # the model in use sits idle for longer than the setting and stays
        await pilot.pause(idle + 1)
        assert gemma.state is ModelState.LOADED and gemma.unload_at is None and app.client.engine is engine
        await send(pilot, "The sea is")
        assert app.store.messages(screen.conv.id)[-1].status == "complete"

        await send(pilot, f"/model {smollm2_path}")
        await until(pilot, lambda: app.client.model_name.lower().startswith("smollm2"), what="smollm2 again")
        assert small.loads == 2 and gemma.unload_at is not None
        await until(pilot, lambda: gemma.state is ModelState.UNLOADED, timeout=60 + idle, what="gemma3 to unload")
        assert [m.name for m in pool.resident()] == [str(smollm2_path)]


@pytest.fixture(scope="module")
def small_client(tmp_path_factory, smollm2_path):
    """A 512-token context: long conversations overflow it quickly."""
    from edgechat.config import get_paths

    c = LocalClient(str(smollm2_path), get_paths(tmp_path_factory.mktemp("tui-small")), n_ctx=512)
    yield c
    c.close()


LONG = " ".join(f"Fact {i}: the lighthouse keeper counted {i * 7} gulls at dawn." for i in range(12))


async def test_eviction_is_announced_and_history_kept(paths, small_client):
    app = app_for(paths, small_client)
    conv = app.store.create_conversation(settings={**app.config.chat})
    for i in range(4):
        app.store.add_message(conv.id, "user", f"Part {i}. {LONG}")
        app.store.add_message(conv.id, "assistant", f"Noted part {i}.")
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await screen.open_conversation(conv.id)
        # the gauge is filled on opening: the whole history no longer fits the context
        await until(pilot, lambda: screen.status.context_used > 512, what="the context gauge")
        await send(pilot, "How many parts did I send?")
        notes = [str(n.render()) for n in screen.chat.query(".note")]
        assert len(notes) == 1 and "oldest messages left the context" in notes[0]
        msgs = app.store.messages(conv.id)
        assert len(msgs) == 10 and msgs[-1].status == "complete"  # nothing deleted from the stored history
        assert screen.status.context_used <= screen.status.context_size == 512


async def test_prompt_too_long_is_refused_and_the_prompt_kept(paths, small_client):
    app = app_for(paths, small_client)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        too_long = " ".join([LONG] * 4)
        await send(pilot, too_long)
        assert any("tokens but this context allows" in n.message for n in app._notifications)
        assert app.store.messages(screen.conv.id) == [] and screen.chat.boxes() == []
        assert screen.prompt.text == too_long


async def test_switching_chats_while_answering(paths, client):
    """The answer keeps streaming while the user looks at (and types in) another conversation."""
    app = app_for(paths, client)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        other = app.store.create_conversation(title="Other chat")
        app.store.add_message(other.id, "user", "earlier question")
        busy = app.store.create_conversation(settings={**app.config.chat, "max_tokens": 3000, "loop_guard": False})
        await screen.open_conversation(busy.id)
        screen.prompt.set_text(LOOPING)
        await pilot.press("enter")
        await until(pilot, lambda: screen.turn is not None and len(screen.turn.text) > 3, what="some text")
        try:
            await screen.open_conversation(other.id)
            assert [b.text for b in screen.chat.boxes()] == ["earlier question"]
            # (Pilot waits for the app to go idle after each key, which it never does while streaming: few keys)
            await pilot.press("o", "k")
            assert screen.prompt.text == "ok"
            away = len(screen.turn.text)
            await screen.open_conversation(busy.id)
            live = screen.chat.boxes()[-1]
            # what arrived while away is shown (tokens still arrive: the box may trail by a flush)
            assert live.streaming and len(live.text) >= away and screen.turn.text.startswith(live.text)
            shown = len(live.text)
            await until(pilot, lambda: len(live.text) > shown, what="more text in the reopened view")
            await pilot.press("escape")
            await until(pilot, lambda: screen.turn is None, what="the stop")
            await pilot.pause(0.05)
        finally:
            if screen.turn is not None:  # a failed check must not leave the shared engine answering
                screen.action_stop()
        answer = app.store.messages(busy.id)[-1]
        assert answer.status == "interrupted" and live.text == answer.content and not live.streaming


async def test_usable_while_the_model_loads(paths, client):
    """Typing and sending work before the model is up; the message is answered once it is."""
    import threading

    gate = threading.Event()

    def slow_factory(ref):
        gate.wait(30)  # a model that takes a while to load
        return client

    app = EdgechatApp(paths, client_factory=slow_factory)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        await pilot.press(*"Hello early")
        assert screen.prompt.text == "Hello early" and app.client is None
        assert "loading" in screen.status.state
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert [m.content for m in app.store.messages(screen.conv.id)] == ["Hello early", ""]
        gate.set()
        await until(pilot, lambda: app.client is not None and screen.turn is None and screen.turn_part.waiting is None)
        await pilot.pause(0.05)
        answer = app.store.messages(screen.conv.id)[-1]
        assert answer.status == "complete" and answer.content.strip()
        assert screen.chat.boxes()[-1].text == answer.content


#: an answer that re-quotes its prompt: what n-gram lookup guesses well
REPEAT = "Repeat this sentence exactly: The old lighthouse keeper climbed the stairs every night to light the lamp."


async def test_speculative_lookup_shows_acceptance_and_answers_as_plain_decoding(paths, client):
    """A conversation set to speculative "lookup" shows the last answer's acceptance in the status
    bar, even at a phone's 50 columns, and stores the same greedy answer as one set to "off"."""
    app = app_for(paths, client)
    async with app.run_test(size=(50, 30)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        answers, bars = {}, {}
        for mode in ("off", "lookup"):
            conv = app.store.create_conversation(settings={**app.config.chat, "max_tokens": 40, "speculative": mode})
            await screen.open_conversation(conv.id)
            await send(pilot, REPEAT)
            answers[mode] = stored(app)[-1]
            bars[mode] = screen.status.render()
        assert answers["lookup"] == answers["off"] and answers["off"][2] == "complete"
        assert "lighthouse" in answers["off"][1]
        assert "guessed" not in bars["off"].plain
        # the figure is whole on the screen: the model's name, not the figures, gave way to fit
        assert bars["lookup"].cell_len <= screen.status.content_size.width, bars["lookup"].plain
        assert re.search(r"│ \d+\.\d tok/s │ guessed \d+%$", bars["lookup"].plain), bars["lookup"].plain
        assert screen.status.spec > 0


@pytest.mark.parametrize("size", [(80, 24), (50, 30)])
async def test_notifications_never_cover_the_input(paths, client, size):
    """Edit, export, branch, delete and undo each say something; none of it lands on the input,
    where the text being edited is. The delete dialog's button says what it does and takes Enter."""
    from textual.widgets._toast import Toast

    from edgechat.tui.screens.dialogs import ConfirmScreen

    app = app_for(paths, client)
    async with app.run_test(size=size, notifications=True) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await send(pilot, "Name a color.")

        async def check(what: str) -> None:
            await until(pilot, lambda: any(t.region for t in app.screen.query(Toast)), what=f"the {what} toast")
            prompt = screen.prompt.region
            for toast in app.screen.query(Toast):
                assert not toast.region.overlaps(prompt), (what, toast.region, prompt)

        await pilot.press("ctrl+g")  # edit the last message: its text in the input, a toast saying how
        assert screen.prompt.text == "Name a color."
        await check("edit")
        await pilot.press("escape")
        await send(pilot, "/export")
        await check("export")
        await send(pilot, "/branch")
        await check("branch")
        branch = screen.conv
        await send(pilot, "/delete")
        assert isinstance(app.screen, ConfirmScreen)
        assert str(app.screen.focused.label) == "Delete conversation"
        await pilot.press("enter")
        await until(pilot, lambda: screen.conv is None, what="the delete")
        assert app.store.get_conversation(branch.id) is None
        await check("delete")
        await send(pilot, "/undo")
        await check("undo")
        assert app.store.get_conversation(branch.id) is not None


async def test_export_names_the_model_of_each_answer(paths, client):
    """A conversation answered first by one model and then by another: the export names both in
    its header, and each answer under its own model."""
    app = app_for(paths, client)
    conv = app.store.create_conversation(model="gemma3-270m", settings={**app.config.chat})
    app.store.add_message(conv.id, "user", "Name a color.")
    app.store.add_message(conv.id, "assistant", "Blue.", meta={"model": "gemma3-270m"})
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        await screen.open_conversation(conv.id)
        await send(pilot, "Name a fruit.")
        await send(pilot, "/export")
        (exported,) = (paths.data / "exports").iterdir()
    text = exported.read_text()
    assert app.store.get_conversation(conv.id).model == client.model_name  # the last model, as before
    assert f"· models gemma3-270m, {client.model_name}*" in text
    assert "## Assistant (gemma3-270m)\n\nBlue." in text
    assert f"## Assistant ({client.model_name})\n\n" in text


async def test_the_empty_screen_says_the_embedded_model_is_a_demo(paths, monkeypatch):
    """A newcomer's first screen: the embedded SmolLM2 is a small demo model, and the one command
    that pulls a real one names the largest catalog model that fits this machine's free memory."""
    from edgechat.models import planner
    from edgechat.models.catalog import load_catalog
    from edgechat.tui.widgets.chatview import Markdown

    monkeypatch.setattr(planner, "available_memory", lambda: 1 << 30)  # 1 GiB free
    fits = [e for e in load_catalog().values() if planner.weights_fit(e.default.size)]
    best = max(fits, key=lambda e: e.default.size)
    assert len(fits) < len(load_catalog())  # the choice is not simply the largest entry
    app = EdgechatApp(paths)  # what `edgechat chat` opens: the embedded model, loaded by the app
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        assert app.client.model_name == "smollm2-135m-instruct"
        await until(pilot, lambda: screen.chat.query(".welcome"), what="the welcome")
        await pilot.pause(0.2)
        (welcome,) = screen.chat.query(".welcome")
        text = welcome.source if isinstance(welcome, Markdown) else str(welcome.render())
        assert "smollm2-135m-instruct** is the small demo model" in text
        assert f"edgechat pull {best.name}\n" in text and f"/model {best.name}" in text
        assert welcome.region.height > 0
        await send(pilot, "Name a color.")
        assert not screen.chat.query(".welcome")  # the conversation has begun
        await send(pilot, "/new")
        assert screen.chat.query(".welcome")  # and an empty one says it again
