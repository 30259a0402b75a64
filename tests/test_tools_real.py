"""Tool calls and structured output on a real instruct model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M,
fetched once per machine: bench/realmodel.py), through the real server and the official clients,
with `tool_choice: "auto"`, the default agents send. This model writes its calls as bare or
```json-fenced objects rather than in its template's <tool_call> blocks; they must reach the client
as calls, streamed and whole alike, and never as content.

What a 0.5B model cannot show: at temperature 0 it writes one call where two were asked for (its
own text holds one), so two calls in one turn are proven on synthetic streams
(tests/test_tool_families.py) and on SmolLM2 with `required` (tests/test_server_agents.py). Given
a tool's result, it writes the same call again (with llama-server too, as its text): that echo is
the answer's text, not a new call, or an agent's loop would never end."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from serving import serving

from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams
from edgechat.engine.output.tools import tool_grammar
from edgechat.server import ServerSettings, create_app
from edgechat.server.tools import parse_tools

pytestmark = pytest.mark.slow
MODEL = "qwen-coder"


def fn(name: str, description: str, props: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props, "required": list(props)}}}


WEATHER = fn("get_weather", "Current weather in a city", {"city": {"type": "string"}})
SIX = [
    WEATHER,
    fn("get_time", "Current local time in a city", {"city": {"type": "string"}}),
    fn("send_email", "Send an email", {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}}),
    fn("search_web", "Search the web", {"query": {"type": "string"}}),
    fn("convert_currency", "Convert an amount between currencies", {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}}),
    fn("create_event", "Create a calendar event", {"title": {"type": "string"}, "date": {"type": "string"}}),
]


@pytest.fixture(scope="module")
def engine(qwen_coder_path):
    eng = Engine(EngineConfig(model=str(qwen_coder_path), n_ctx=4096, n_parallel=2))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_url(engine):
    with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), engine)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)


def ask(client, content: str, tools: list[dict], **extra):
    """(content, [(name, arguments)]) whole, and the same streamed: the calls must agree, and so
    must the text where the answer is calls (a prose answer may part at a near tie: the second
    request reads its prompt from the first's cached cells)."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": content}], tools=tools, temperature=0, max_tokens=150, **extra)
    whole = client.chat.completions.create(**args).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
    text, parts, reason = "", {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for c in delta.tool_calls or []:
            part = parts.setdefault(c.index, ["", ""])
            part[0] += c.function.name or ""
            part[1] += c.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    streamed = [(name, json.loads(arguments)) for name, arguments in (parts[i] for i in sorted(parts))]
    assert streamed == calls and (text == (whole.message.content or "") or not calls), "streamed differs from whole"
    assert bool(text) == bool(whole.message.content)
    assert reason == whole.finish_reason == ("tool_calls" if calls else "stop")
    return whole.message.content or "", calls


@pytest.mark.parametrize(("question", "tools", "call"), [
    ("What's the weather in Paris?", [WEATHER], ("get_weather", {"city": "Paris"})),
    ("What time is it in Berlin?", SIX, ("get_time", {"city": "Berlin"})),
    ("Convert 100 US dollars to euros.", SIX, ("convert_currency", {"amount": 100, "from": "USD", "to": "EUR"})),
    ("Search the web for llama.cpp", SIX, ("search_web", {"query": "llama.cpp"})),
], ids=["one tool", "one of six", "number arguments", "search"])
def test_the_models_own_json_calls_reach_the_client_as_calls(client, question, tools, call):
    content, calls = ask(client, question, tools)
    assert calls == [call] and content == ""


@pytest.mark.parametrize("question", ["Write a haiku about the sea.", "Hello! How are you?"])
def test_no_call_when_none_is_wanted(client, question):
    content, calls = ask(client, question, SIX[:2])
    assert calls == [] and len(content) > 10 and "{" not in content


def test_a_call_written_again_right_after_its_result_is_the_answer_not_a_new_call(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temperature_c": 18, "sky": "cloudy"}'}]
    for seed in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0.7, seed=seed).choices[0]
        assert not answer.message.tool_calls and answer.finish_reason == "stop" and answer.message.content, answer


def test_a_call_to_a_function_nobody_declared_stays_text(engine):
    """Asked to greet with only a weather tool, this model calls a `greet` it made up; that is
    no call of ours, so it is the answer's text (held to the tools, it would be a wrong call)."""
    tools = parse_tools({"tools": [WEATHER]})
    req = ChatRequest(messages=[{"role": "user", "content": "Say hello to me."}], tools=tools,
                      grammar=tool_grammar(tools, engine.format.tool_family), sampling=SamplingParams(temperature=0), max_tokens=60)
    out = engine.submit(req).result()
    assert out.tool_calls == [] and out.text.startswith("{") and '"name"' in out.text
    assert json.loads(out.text)["name"] != "get_weather"


def test_the_lazy_grammar_keeps_a_started_call_valid(engine):
    """Sampled (temperature 1, fixed seeds), the model's own calls break the tool's schema (a
    date-time where the pattern allows a date), so they are no calls and stay text; once a call
    starts, the grammar holds each to the offered tools, and every one fits its schema."""
    event = fn("create_event", "Create a calendar event",
               {"title": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})
    tools = parse_tools({"tools": [event, SIX[1]]})
    broken, valid = 0, 0
    for seed in range(4):
        common = dict(messages=[{"role": "user", "content": "Create a calendar event called Dentist for next Friday."}], tools=tools,
                      max_tokens=80, sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed), speculative="off")
        free = engine.submit(ChatRequest(**common)).result()
        lazy = engine.submit(ChatRequest(**common, grammar=tool_grammar(tools, engine.format.tool_family))).result()
        broken += not free.tool_calls and '"create_event"' in free.text
        for call in lazy.tool_calls:
            jsonschema.validate(json.loads(call.arguments), event["function"]["parameters"])
        valid += [c.name for c in lazy.tool_calls] == ["create_event"]
    assert broken >= 1 and valid == 4, (broken, valid)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "biography": {"type": "string"},
                                           "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                                           "age": {"type": "integer"}},
          "required": ["name", "biography", "skills", "age"], "additionalProperties": False}


@pytest.mark.parametrize("max_tokens", [24, 48, 96])
def test_a_json_schema_answer_cut_by_max_tokens_still_parses_and_validates(client, max_tokens):
    out = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": "Invent a person with a long, detailed biography of several paragraphs."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    ).choices[0]
    jsonschema.validate(json.loads(out.message.content), PERSON)
    assert out.finish_reason in ("length", "stop")


def test_apply_template_with_tools_equals_the_prompt_the_chat_request_decodes(base_url, engine):
    import httpx

    body = {"messages": [{"role": "user", "content": "What's the weather in Paris?"}], "tools": SIX}
    prompt = httpx.post(f"{base_url}/apply-template", json=body, timeout=60).json()["prompt"]
    assert '"name": "convert_currency"' in prompt  # the tools are in it
    prepared = engine.prepare(ChatRequest(messages=body["messages"], tools=parse_tools(body)))
    assert engine.prompt_text_tokens(prompt, True) == list(prepared.tokens)


def test_anthropic_and_responses_clients_get_the_same_call(base_url):
    msg = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=300).messages.create(
        model=MODEL, max_tokens=150, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=[{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER["function"]["parameters"]}],
    )
    uses = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
    assert uses == [("get_weather", {"city": "Paris"})] and msg.stop_reason == "tool_use"
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    response = client.responses.create(model=MODEL, input="What's the weather in Paris?", temperature=0, max_output_tokens=150,
                                       tools=[{"type": "function", **WEATHER["function"]}])
    calls = [(i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"]
    assert calls == [("get_weather", {"city": "Paris"})]
