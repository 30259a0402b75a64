"""Anthropic's Messages API end to end: real engine, real SmolLM2, uvicorn on loopback, Anthropic's own client."""

from __future__ import annotations

import concurrent.futures
import json
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest
from serving import serving

from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.server import ServerSettings, create_app

KEY = "sk-test-key"
MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant."
HI = [{"role": "user", "content": "Say hello."}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
#: greedy decoding; Anthropic's SDK 2.x no longer takes sampling fields as arguments, the API still does
GREEDY = {"extra_body": {"temperature": 0}}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(models_root):
    # deterministic: the tests compare greedy texts across requests, which otherwise may part at
    # a near-tie (a prompt found in the cache is computed in another batch shape than a fresh one)
    eng = Engine(EngineConfig(model=MODEL, n_ctx=1024, max_queue=4, deterministic=True, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_url(engine):
    settings = ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None)
    with serving(create_app(settings, engine)) as url:
        yield url


@pytest.fixture
def client(base_url):
    # the SDK sends the key as x-api-key
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)


def sse_events(base_url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) for each event of a streamed /v1/messages, in order."""
    out = []
    with httpx.stream("POST", f"{base_url}/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


def test_create_and_stream_give_the_same_greedy_message(client):
    args = dict(model=MODEL, max_tokens=16, system=SYSTEM, messages=HI, **GREEDY)
    full = client.messages.create(**args)
    assert full.type == "message" and full.role == "assistant" and full.model == MODEL and full.id.startswith("msg_")
    [block] = full.content
    assert block.type == "text" and block.text
    assert full.stop_reason in ("end_turn", "max_tokens") and full.stop_sequence is None
    assert 0 < full.usage.output_tokens <= 16
    assert full.usage.input_tokens + full.usage.cache_read_input_tokens > 5

    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text
    assert final.content[0].text == block.text and final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens


def test_stream_events_come_in_anthropics_order(base_url):
    events = sse_events(base_url, dict(model=MODEL, max_tokens=12, temperature=0, messages=HI))
    assert all(name == data["type"] for name, data in events)
    kinds = [name for name, _ in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1
    assert kinds == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * deltas + [
        "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 5
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert {d["index"] for n, d in events if n == "content_block_delta"} == {0}
    assert {d["delta"]["type"] for n, d in events if n == "content_block_delta"} == {"text_delta"}
    end = events[-2][1]
    assert end["delta"]["stop_reason"] in ("end_turn", "max_tokens") and end["usage"]["output_tokens"] > 0


def test_greedy_text_equals_the_openai_endpoints(client, base_url):
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    chat = oai.chat.completions.create(model=MODEL, max_tokens=20, temperature=0,
                                       messages=[{"role": "system", "content": SYSTEM}, *HI])
    message = client.messages.create(model=MODEL, max_tokens=20, system=[{"type": "text", "text": SYSTEM}], messages=HI, **GREEDY)
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_count_tokens_is_the_engines_count(client, engine):
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HI)
    assert counted.input_tokens == engine.count_tokens(ChatRequest(messages=[{"role": "system", "content": SYSTEM}, *HI]))
    sent = client.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=HI)
    assert sent.usage.input_tokens + sent.usage.cache_read_input_tokens == counted.input_tokens


def test_stop_sequence_ends_the_answer_and_is_named(client):
    args = dict(model=MODEL, max_tokens=20, messages=HI, **GREEDY)
    whole = client.messages.create(**args).content[0].text
    stop = whole.split()[1]  # a word the greedy answer writes
    out = client.messages.create(**args, stop_sequences=["not in the answer", stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == whole[: whole.index(stop)]


def test_forced_tool_use_then_its_result_goes_back_in(client, engine):
    first = client.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])

    # streamed, the same call arrives as input_json_delta and the SDK rebuilds the same input
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and [b.input for b in streamed.content if b.type == "tool_use"] == [call.input]

    messages = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees and sunny"}]}]
    second = client.messages.create(model=MODEL, max_tokens=40, messages=messages, tools=[WEATHER],
                                    tool_choice={"type": "none"}, **GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and "<tool_call>" not in second.content[0].text
    # the tool's result reached the prompt: it counts more tokens than the turn without it
    with_result = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    without = client.messages.count_tokens(model=MODEL, messages=messages[:2] + [{"role": "user", "content": "ok"}], tools=[WEATHER])
    assert with_result.input_tokens > without.input_tokens
    stats = engine.stats()
    assert stats["running"] == 0


def test_errors_come_in_anthropics_shape(client, base_url):
    with pytest.raises(anthropic.BadRequestError) as info:
        # the SDK insists on max_tokens itself: send the body as is
        client.post("/v1/messages", body={"model": MODEL, "messages": HI}, cast_to=httpx.Response)
    assert info.value.status_code == 400
    assert info.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: field required"}}

    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(model=MODEL, max_tokens=2, messages=HI)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"
    # Authorization: Bearer works as well as x-api-key
    bearer = anthropic.Anthropic(base_url=base_url, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model=MODEL, messages=HI).input_tokens > 0

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [image]}])
    assert "image" in info.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "x"}]}])
    assert "tool_use_id" in info.value.body["error"]["message"]

    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-opus-4", max_tokens=2, messages=HI)
    assert info.value.body["error"]["type"] == "not_found_error"

    r = httpx.get(f"{base_url}/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_full_queue_and_disconnect_keep_the_servers_properties(client, base_url, engine):
    def one(_):
        try:
            client.messages.create(model=MODEL, max_tokens=24, messages=HI, **GREEDY)
            return 200, None
        except anthropic.APIStatusError as exc:
            return exc.status_code, exc.body

    # one sequence (deterministic) and 4 places in the queue: the rest are refused at once, as
    # Anthropic's overloaded_error, which its clients retry after Retry-After
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert sum(s == 200 for s, _ in results) >= 1 and any(s == 529 for s, _ in results), results
    assert all(s == 200 or (s == 529 and b["error"]["type"] == "overloaded_error") for s, b in results), results

    # a client leaving mid-stream frees its sequence
    body = {"model": MODEL, "max_tokens": 400, "messages": HI, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        assert next(r.iter_lines()) == "event: message_start"
    deadline = time.monotonic() + 5
    while engine.stats()["running"] + engine.stats()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["running"] == 0
    assert engine.kv_problems() == []
