"""Remote mode: the chat app talking to edgechat's own OpenAI-compatible server (real engine, real SmolLM2),
and to a small stand-in server that records request bodies and fails on cue."""

from __future__ import annotations

import json
import time

import pytest
from serving import serving

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
    """A server that cancels answers running over 1 s: it sends an error event in the middle of the stream
    (after the first chunk, and after some text unless the machine is too loaded for any in a second)."""
    with serving(create_app(ServerSettings(api_key=KEY, model_id="smollm2", request_timeout=1.0), engine)) as url:
        yield url


def openai_double(events: list[dict | str], bodies: list[dict]):
    """A stand-in for an OpenAI-compatible server that records each request body and streams `events`:
    for what our own server cannot be made to do on cue."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "double"}]})

    async def chat(request):
        bodies.append(await request.json())
        lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
        return StreamingResponse(iter(lines), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


def delta(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


async def answer_in_app(app, pilot, text: str):
    """Wait for the client, send `text`, wait for the answer to end; returns the stored (user, answer)."""
    deadline = time.monotonic() + 30
    while app.client is None:
        assert time.monotonic() < deadline
        await pilot.pause(0.05)
    screen = app.chat_screen
    screen.prompt.set_text(text)
    await pilot.press("enter")
    while screen.turn is not None:
        assert time.monotonic() < deadline + 60
        await pilot.pause(0.05)
    await pilot.pause(0.05)
    return app.store.messages(screen.conv.id)


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
        ChatRequest(
            messages=[{"role": "user", "content": LOOPING}], max_tokens=900, sampling=SamplingParams(temperature=0.0),
            loop_guard=False,  # the server's timeout must cut it, not the loop guard
        )
    )
    events = list(handle)
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    fin = events[-1]
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
    # edgechat serve takes the conversation's speculative setting (a value it refused would fail the answer)
    isolated_dirs.config_file.write_text('[chat]\nmax_tokens = 10\ntemperature = 0.0\nspeculative = "lookup"\n')
    app = EdgechatApp(isolated_dirs, url=server_url, api_key=KEY)
    async with app.run_test(size=(100, 30)) as pilot:
        msgs = await answer_in_app(app, pilot, "What is 2+2?")
        assert app.chat_screen.status.backend == f"remote {server_url}"
        assert [(m.role, m.status) for m in msgs] == [("user", "complete"), ("assistant", "complete")]
        assert msgs[1].content.strip() and app.chat_screen.chat.boxes()[-1].text == msgs[1].content
        assert msgs[1].meta["completion_tokens"] > 0
    assert app.client is None  # quitting closed the HTTP client


@pytest.mark.asyncio
async def test_app_stores_an_answer_cut_off_by_the_server_as_an_error(cutoff_url, isolated_dirs):
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 900\ntemperature = 0.0\nloop_guard = false\n")
    app = EdgechatApp(isolated_dirs, url=cutoff_url, api_key=KEY)
    async with app.run_test(size=(100, 30)) as pilot:
        user, answer = await answer_in_app(app, pilot, LOOPING)
        assert (user.status, answer.status) == ("complete", "error")
        assert answer.meta["error"] == "the server stopped the answer: the request timed out and was cancelled"
        box = app.chat_screen.chat.boxes()[-1]
        assert box.has_class("-error") and box.text == answer.content
        assert str(box.query_one(".status-note").render()) == f"(error: {answer.meta['error']})"
        assert any(n.message == f"The answer failed: {answer.meta['error']}" for n in app._notifications)


FAILURE = {"error": {"message": "the engine failed", "type": "server_error", "code": "error"}}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "ending, error",
    [
        # our server's shape of a failure mid-answer: text chunks, then an error event and no [DONE]
        ([FAILURE], "the server stopped the answer: the engine failed"),
        # a stream that ends without a finish reason (a proxy timing out, a server killed) is not complete
        ([], "the server closed the stream before the answer ended"),
    ],
)
async def test_app_keeps_the_text_of_an_answer_cut_off_and_marks_it_an_error(isolated_dirs, ending, error):
    with serving(openai_double([delta("Hello, "), delta("wor"), *ending], [])) as url:
        app = EdgechatApp(isolated_dirs, url=url)
        async with app.run_test(size=(100, 30)) as pilot:
            user, answer = await answer_in_app(app, pilot, "hi")
    assert (answer.content, answer.status) == ("Hello, wor", "error")
    assert answer.meta["error"] == error


@pytest.mark.asyncio
@pytest.mark.parametrize("speculative", ["lookup", "auto"])
async def test_app_sends_every_sampling_setting(isolated_dirs, speculative):
    """The server samples as the conversation says: every setting is in the request body. Speculative
    decoding is edgechat's own field, sent only when not the default (a foreign server never sees it)."""
    import tomli_w

    settings = {
        "temperature": 0.2,
        "top_p": 0.8,
        "top_k": 7,
        "min_p": 0.1,
        "repeat_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "seed": 3,
        "max_tokens": 5,
    }
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text(tomli_w.dumps({"chat": {**settings, "speculative": speculative}}))
    bodies: list[dict] = []
    with serving(openai_double([delta("ok", "stop"), "[DONE]"], bodies)) as url:
        app = EdgechatApp(isolated_dirs, url=url)
        async with app.run_test(size=(100, 30)) as pilot:
            user, answer = await answer_in_app(app, pilot, "hi")
    assert (answer.content, answer.status) == ("ok", "complete")
    (body,) = bodies
    assert {k: body.get(k) for k in settings} == settings
    assert body.get("speculative") == (None if speculative == "auto" else speculative)
