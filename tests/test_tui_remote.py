"""Remote mode: the chat app talking to edgechat's own OpenAI-compatible server (real engine, real SmolLM2)."""

from __future__ import annotations

import time

import pytest

from edgechat.engine import (
    ChatRequest,
    Engine,
    EngineConfig,
    Finished,
    Metrics,
    SamplingParams,
    TextDelta,
)
from edgechat.errors import EdgechatError
from edgechat.server import ServerSettings, create_app
from edgechat.tui.app import EdgechatApp
from edgechat.tui.client import RemoteClient
from serving import serving

pytestmark = pytest.mark.slow

KEY = "sekrit"


#: greedy SmolLM2 answers this with a phrase repeated until max_tokens: an answer still running when cut off
LOOPING = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_path):
    from edgechat.config import get_paths

    engine = Engine(EngineConfig(model=str(smollm2_path), n_ctx=1024, paths=get_paths(tmp_path_factory.mktemp("srv"))))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server_url(engine):
    with serving(create_app(ServerSettings(api_key=KEY, model_id="smollm2"), engine)) as url:
        yield url


@pytest.fixture(scope="module")
def cutoff_url(engine):
    """A server that cancels answers running over 4 s: it sends an error event in the middle of the stream."""
    with serving(create_app(ServerSettings(api_key=KEY, model_id="smollm2", request_timeout=4.0), engine)) as url:
        yield url


def test_remote_client_streams_events_like_the_engine(server_url):
    client = RemoteClient(server_url, KEY)
    assert client.model_name == "smollm2"
    handle = client.submit(
        ChatRequest(
            messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, sampling=SamplingParams(temperature=0.0)
        )
    )
    events = list(handle)
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert deltas and isinstance(events[-2], Metrics) and isinstance(events[-1], Finished)
    fin = events[-1]
    assert fin.reason in ("stop", "length") and fin.text == "".join(deltas)
    assert fin.metrics.completion_tokens > 0 and fin.metrics.ttft > 0
    client.close()


def test_remote_client_cancel_stops_the_stream(server_url):
    client = RemoteClient(server_url, KEY)
    handle = client.submit(ChatRequest(messages=[{"role": "user", "content": "Write a long story."}], max_tokens=400))
    got = []
    for event in handle:
        got.append(event)
        if isinstance(event, TextDelta) and len(got) == 3:
            handle.cancel()
    assert isinstance(got[-1], Finished) and got[-1].reason == "cancelled"
    assert sum(isinstance(e, TextDelta) for e in got) < 50
    client.close()


def test_remote_client_error_mid_stream_ends_in_error(cutoff_url):
    client = RemoteClient(cutoff_url, KEY)
    handle = client.submit(
        ChatRequest(messages=[{"role": "user", "content": LOOPING}], max_tokens=900, sampling=SamplingParams(temperature=0.0))
    )
    events = list(handle)
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    fin = events[-1]
    assert deltas, "the answer was cut off before any text came"
    assert isinstance(fin, Finished) and fin.reason == "error" and fin.text == "".join(deltas)
    assert fin.error == "the server stopped the answer: the request timed out and was cancelled"
    client.close()


def test_remote_errors_are_one_line(server_url):
    with pytest.raises(EdgechatError, match="401"):
        RemoteClient(server_url, "wrong-key")
    with pytest.raises(EdgechatError, match="cannot reach"):
        RemoteClient("http://127.0.0.1:9", None)


@pytest.mark.asyncio
async def test_app_in_remote_mode(server_url, isolated_dirs):
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 10\ntemperature = 0.0\n")
    app = EdgechatApp(isolated_dirs, url=server_url, api_key=KEY)
    async with app.run_test(size=(100, 30)) as pilot:
        deadline = time.monotonic() + 30
        while app.client is None:
            assert time.monotonic() < deadline
            await pilot.pause(0.05)
        screen = app.chat_screen
        assert screen.status.backend == f"remote {server_url}"
        screen.prompt.set_text("What is 2+2?")
        await pilot.press("enter")
        while screen.turn is not None:
            assert time.monotonic() < deadline + 60
            await pilot.pause(0.05)
        await pilot.pause(0.05)
        msgs = app.store.messages(screen.conv.id)
        assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "complete")]
        assert msgs[1].content.strip() and screen.chat.boxes()[-1].text == msgs[1].content
        assert msgs[1].meta["completion_tokens"] > 0
    assert app.client is None  # quitting closed the HTTP client


@pytest.mark.asyncio
async def test_app_stores_an_answer_cut_off_by_the_server_as_an_error(cutoff_url, isolated_dirs):
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 900\ntemperature = 0.0\n")
    app = EdgechatApp(isolated_dirs, url=cutoff_url, api_key=KEY)
    async with app.run_test(size=(100, 30)) as pilot:
        deadline = time.monotonic() + 30
        while app.client is None:
            assert time.monotonic() < deadline
            await pilot.pause(0.05)
        screen = app.chat_screen
        screen.prompt.set_text(LOOPING)
        await pilot.press("enter")
        while screen.turn is not None:
            assert time.monotonic() < deadline + 60
            await pilot.pause(0.05)
        await pilot.pause(0.05)
        user, answer = app.store.messages(screen.conv.id)
        assert (user.status, answer.status) == ("complete", "error")
        assert answer.content.strip() and answer.meta["error"].endswith("the request timed out and was cancelled")
        box = screen.chat.boxes()[-1]
        assert box.has_class("-error") and box.text == answer.content
        assert "timed out" in str(box.query_one(".status-note").render())
        assert any("The answer failed" in n.message and "timed out" in n.message for n in app._notifications)
