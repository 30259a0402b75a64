"""OpenAI's Responses API end to end: real engine, real SmolLM2, uvicorn on loopback, the openai SDK's own parsing."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest
from serving import serving

from bench.bench_reasoning import TEMPLATE as THINK_TEMPLATE
from edgechat.engine import Engine, EngineConfig
from edgechat.server import ServerSettings, create_app
from edgechat.store.responses import ResponseStore

KEY = "sk-test-key"
MODEL = "smollm2-135m-instruct"
#: SmolLM2 answers this greedily in 11 tokens and stops (most prompts run on to any limit)
ASK = "What is 2+2?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
FORCED = {"type": "function", "name": "get_weather"}
#: the protocol of one streamed text answer, between created/in_progress and the end
TEXT_ITEM = ["response.output_item.added", "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]

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
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def streamed(client, **args) -> list:
    """The SDK's parsed events of a streamed response: each is its own typed model, or the SDK
    did not recognise it."""
    events = list(client.responses.create(model=MODEL, stream=True, **args))
    assert all(type(e).__module__.startswith("openai.types.responses") for e in events), [type(e) for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def as_input(output) -> list[dict]:
    """A response's output items as the next request's input (a client keeping state itself)."""
    return [item.model_dump(exclude_none=True) for item in output]


def test_create_answers_and_equals_chat_completions_greedy_text(client):
    response = client.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.status == "completed" and response.incomplete_details is None and response.error is None
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [p.type for p in message.content] == ["output_text"]
    assert "4" in response.output_text
    usage = response.usage
    assert usage.input_tokens > 5 and 0 < usage.output_tokens < 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens_details.reasoning_tokens == 0

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=24, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert usage.output_tokens == chat.usage.completion_tokens and usage.input_tokens == chat.usage.prompt_tokens

    # instructions are the system prompt, as a chat's system message
    told = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
                                   instructions="You are a helpful assistant.", max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": ASK}])
    assert told.output_text == chat.choices[0].message.content and told.instructions == "You are a helpful assistant."
    assert told.status == "incomplete" and told.incomplete_details.reason == "max_output_tokens"
    assert told.output[0].status == "incomplete" and told.usage.output_tokens == 6


def test_stream_events_follow_the_protocol(client):
    events = streamed(client, input=ASK, max_output_tokens=24, temperature=0)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == ["response.created", "response.in_progress", *TEXT_ITEM,
                     *["response.output_text.delta"] * deltas, *TEXT_DONE, "response.completed"]
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None and created.id == final.id
    added, part = events[2], events[3]
    item_id = added.item.id
    assert added.output_index == 0 and added.item.type == "message" and added.item.status == "in_progress" and added.item.content == []
    assert (part.item_id, part.output_index, part.content_index, part.part.text) == (item_id, 0, 0, "")
    body = events[4:4 + deltas]
    assert {(e.item_id, e.output_index, e.content_index) for e in body} == {(item_id, 0, 0)}
    text_done, part_done, item_done = events[-4:-1]
    text = "".join(e.delta for e in body)
    assert text_done.text == text == part_done.part.text == item_done.item.content[0].text
    assert item_done.item.id == item_id and item_done.item.status == "completed"
    assert final.status == "completed" and final.output_text == text and final.usage.output_tokens > 0
    whole = client.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0)
    assert text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens

    # the SDK's own accumulator agrees
    with client.responses.stream(model=MODEL, input=ASK, max_output_tokens=24, temperature=0) as stream:
        assert stream.get_final_response().output_text == text

    # cut by max_output_tokens: OpenAI's incomplete status and event
    cut = streamed(client, input=ASK, max_output_tokens=3, temperature=0)
    assert [e.type for e in cut][-4:] == [*TEXT_DONE, "response.incomplete"]
    assert cut[-1].response.status == "incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-2].item.status == "incomplete" and cut[-1].response.usage.output_tokens == 3


def test_a_tool_round_trip(client):
    args = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice=FORCED, max_output_tokens=48, temperature=0)
    response = client.responses.create(**args)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.tool_choice.name == "get_weather" and response.tools[0].name == "get_weather"

    events = streamed(client, **{k: v for k, v in args.items() if k != "model"})
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta", "response.function_call_arguments.done",
                                        "response.output_item.done", "response.completed"]
    added, delta, done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.item.status == "in_progress"
    assert {delta.item_id, done.item_id, item_done.item.id} == {added.item.id}
    assert delta.delta == done.arguments == item_done.item.arguments == call.arguments
    assert events[-1].response.output[0].call_id == item_done.item.call_id

    # the result goes back, after the stored call (previous_response_id: the same as sending the
    # whole history, test_previous_response_id_continues_and_get_delete shows)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees and sunny"}
    answer = client.responses.create(model=MODEL, previous_response_id=response.id, input=[result], tools=[WEATHER],
                                     max_output_tokens=6, temperature=0)
    assert answer.output[0].type == "message" and answer.output_text and answer.previous_response_id == response.id
    assert answer.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens
    # a result whose call the stored response did not make is refused
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, previous_response_id=response.id,
                                input=[{**result, "call_id": "call_other"}], max_output_tokens=6)
    assert bad.value.body["param"] == "input[0].call_id"


def test_previous_response_id_continues_and_get_delete(client, base_url):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=6, temperature=0)
    follow = [{"role": "user", "content": "What is my name?"}]
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=follow, max_output_tokens=6, temperature=0)
    manual = client.responses.create(model=MODEL, input=[{"role": "user", "content": "My name is Ada."}, *as_input(first.output), *follow],
                                     max_output_tokens=6, temperature=0, store=False)
    assert chained.output_text == manual.output_text and chained.usage.input_tokens == manual.usage.input_tokens
    assert chained.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert gone.value.body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model=MODEL, previous_response_id=first.id, input=follow, max_output_tokens=4)
    assert unknown.value.body["param"] == "previous_response_id"
    # the chained response keeps its context: the first one's deletion does not break it
    again = client.responses.create(model=MODEL, previous_response_id=chained.id, input="And mine?", max_output_tokens=2, temperature=0)
    assert again.usage.input_tokens > chained.usage.input_tokens
    # store=False keeps nothing
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(manual.id)
    r = httpx.delete(f"{base_url}/v1/responses/{manual.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and set(r.json()) == {"error"}


def test_the_store_keeps_the_newest(tmp_path):
    from edgechat.config import get_paths

    store = ResponseStore(get_paths(tmp_path), keep=3)
    for i in range(5):
        store.put(f"resp_{i}", {"id": f"resp_{i}"}, [{"role": "user", "content": str(i)}])
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.get("resp_4") == ({"id": "resp_4"}, [{"role": "user", "content": "4"}])
    assert store.delete("resp_4") and not store.delete("resp_4")
    store.close()
    # reopened, the migration is not run again and the rows are there
    assert ResponseStore(get_paths(tmp_path)).get("resp_3") is not None


class Answer(pydantic.BaseModel):
    city: str
    sunny: bool


def test_text_format_json_schema_parses(client):
    parsed = client.responses.parse(model=MODEL, input="Describe the weather in Paris as JSON.", text_format=Answer,
                                    max_output_tokens=40, temperature=0)
    assert isinstance(parsed.output_parsed, Answer) and parsed.text.format.type == "json_schema"
    anything = client.responses.create(model=MODEL, input="Describe Paris as JSON.", text={"format": {"type": "json_object"}},
                                       max_output_tokens=30, temperature=0)
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)
    else:
        assert anything.output_text.lstrip().startswith("{")


@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({"input": {"role": "user"}}, "input"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": 5, "call_id": "c"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[1].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": "hi", "tools": [{"type": ["web_search"]}]}, "tools[0].type"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "integer", "minimum": 1}}}}, "text.format.schema"),
    ({"input": "hi", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_input_is_a_400_naming_the_field(base_url, body, param):
    r = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and "\n" not in error["message"]


def test_a_client_leaving_mid_stream_frees_its_sequence(base_url, engine):
    body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert next(r.iter_lines()) == "event: response.created"
    deadline = time.monotonic() + 10
    while engine.stats()["running"] + engine.stats()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["running"] == 0 and engine.kv_problems() == []


@pytest.fixture(scope="module")
def thinker_url(models_root):
    with Engine(EngineConfig(model=MODEL, n_ctx=1024, deterministic=True, paths=models_root, chat_template=THINK_TEMPLATE)) as eng:
        with serving(create_app(ServerSettings(model_id=MODEL), eng)) as url:
            yield url


def test_thoughts_are_a_reasoning_item(thinker_url):
    client = openai.OpenAI(base_url=f"{thinker_url}/v1", api_key="none", max_retries=0, timeout=120)
    args = dict(input="Explain how photosynthesis works.", max_output_tokens=12, temperature=0, extra_body={"reasoning_budget": 4})
    whole = client.responses.create(model=MODEL, **args)
    thought, message = whole.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary == []
    assert thought.content[0].type == "reasoning_text" and thought.content[0].text and "think>" not in thought.content[0].text
    assert message.type == "message" and "think>" not in whole.output_text
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens

    events = streamed(client, **args)
    kinds = [e.type for e in events]
    thinking = kinds.count("response.reasoning_text.delta")
    assert kinds[:4 + thinking + 3] == ["response.created", "response.in_progress", *TEXT_ITEM,
                                        *["response.reasoning_text.delta"] * thinking,
                                        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[4 + thinking + 3:4 + thinking + 5] == TEXT_ITEM and kinds[-1] == "response.incomplete"
    done = events[4 + thinking]
    assert done.text == thought.content[0].text and done.output_index == 0
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    assert events[-1].response.output_text == whole.output_text
