"""What agent frameworks send: tools, structured output, logprobs, n > 1; real SmolLM2 behind
the real server, checked with the official openai client. The grammar guarantees the shapes
even where a 135M model's judgement is weak."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from neartie import assert_same_or_near_tie
from pydantic import BaseModel, Field
from serving import serving

from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.engine.output.schema_grammar import schema_rules
from edgechat.engine.output.tools import ToolCallParser, render_messages
from edgechat.engine.runners.llama import Batch, LlamaBackend
from edgechat.engine.runners.sampling import SamplerChain
from edgechat.models.planner import default_threads
from edgechat.params import Grammar, SamplingParams
from edgechat.server import ServerSettings, create_app
from edgechat.server.tools import parse_tools

KEY = "sk-test-key"
MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The local time in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(models_root):
    eng = Engine(EngineConfig(model=MODEL, n_ctx=2048, n_parallel=2, max_queue=8, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_url(engine):
    with serving(create_app(ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None), engine)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def assert_idle(engine):
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_used"] == 0
    assert engine.kv_problems() == []


# ---------------------------------------------------------------- structured output


class Person(BaseModel):
    # bounded, so even a rambling small model closes the object in time
    name: str = Field(max_length=20)
    age: int
    languages: list[str] = Field(max_length=3)


def test_json_schema_response_is_parsed_by_the_official_client(client, engine):
    out = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a programmer."}],
        response_format=Person,
        max_completion_tokens=150,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person)
    assert_idle(engine)


def test_json_object_streams_as_json_with_speculation_on_or_off(client):
    colours = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}, "required": ["colours"]}
    formats = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "colours", "schema": colours}}]
    for response_format in formats:
        for speculative in ("off", "lookup"):
            # verification samples each drafted position through the same grammar
            args = dict(model=MODEL, messages=[{"role": "user", "content": "List three colours."}], max_tokens=80, temperature=0)
            chunks = list(client.chat.completions.create(**args, response_format=response_format, stream=True, extra_body={"speculative": speculative}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop", text
            value = json.loads(text)
            assert isinstance(value, dict)
            if response_format["type"] == "json_schema":
                assert list(value) == ["colours"] and len(value["colours"]) <= 3


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}, "'minimum'"),
        ({"type": "object", "patternProperties": {"^x": {"type": "string"}}}, "'patternProperties'"),
        ({"type": "object", "properties": {"e": {"type": "string", "format": "email"}}}, "'email'"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "$ref"),
    ],
)
def test_schema_keywords_the_grammar_cannot_enforce_get_400_naming_them(client, engine, schema, keyword):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=5, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
        )
    assert keyword in info.value.message and info.value.param == "response_format.json_schema.schema"
    assert_idle(engine)


def test_a_lazy_grammar_holds_the_text_from_its_trigger_on(engine):
    """How `auto` tool calls are constrained, with a trigger this model does write ('{')."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}
    lazy = Grammar(schema_rules([("", schema)], "test"), "root", (r"[\s\S]*?(\{)[\s\S]*",))
    # with the tools prompt this model answers in a ```json block rather than a call
    messages = render_messages([{"role": "user", "content": "Call get_weather for Paris."}], parse_tools({"tools": [WEATHER]}))
    greedy = SamplingParams(temperature=0)
    free = engine.submit(ChatRequest(messages=messages, sampling=greedy, max_tokens=60, speculative="off")).result()
    held = engine.submit(ChatRequest(messages=messages, sampling=greedy, max_tokens=60, speculative="off", grammar=lazy)).result()
    start = free.text.index("{")
    assert held.text[:start] == free.text[:start]  # free until the trigger
    assert set(json.loads(held.text[start:])) == {"city"} and held.reason == "stop"
    assert free.text[start:] != held.text[start:]


def test_greedy_under_a_grammar_tries_the_top_token_first_and_chooses_as_the_whole_chain(smollm2_path):
    """The top token is checked alone against the grammar; the whole chain runs only when it is
    refused. Step by step on the real model, beside a chain that always runs whole: the same
    token at every step, and both paths taken."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}
    grammar = Grammar(schema_rules([("", schema)], "test"))
    be = LlamaBackend(smollm2_path, n_ctx_total=512, n_seq_max=1, n_threads=default_threads())
    fast, whole = (SamplerChain(SamplingParams(temperature=0), be.n_vocab, be.vocab, grammar) for _ in range(2))
    batch = Batch(512, 1)
    try:
        prompt = be.tokenize("<|im_start|>user\nThe weather in Paris for 3 days, as JSON.<|im_end|>\n<|im_start|>assistant\n")
        for i, tok in enumerate(prompt):
            index = batch.add(tok, i, 0, i == len(prompt) - 1)
        be.decode(batch)
        tried, refused, out = 0, 0, []
        for pos in range(len(prompt), len(prompt) + 40):
            token = fast.allowed_argmax(be.logits(index))
            tried += 1
            if token is None:
                refused += 1
                token = be.sample(fast, index)
            assert token == be.sample(whole, index), (be.detokenize(out), token)
            if be.is_eog(token):
                break
            out.append(token)
            batch.clear()
            index = batch.add(token, pos, 0, True)
            be.decode(batch)
        assert set(json.loads(be.detokenize(out))) == {"city", "days"}
        assert 0 < refused < tried, (refused, tried)
    finally:
        fast.free()
        whole.free()
        batch.close()
        be.close()


# ---------------------------------------------------------------- tools


def _call_args(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    return json.loads(call.function.arguments)


def test_agent_loop_named_tool_then_the_result_goes_back_in(client, engine):
    messages = list(ASK)
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    args = _call_args(call)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="none", max_tokens=40, temperature=0)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    # (a 135M model may well echo the result; what it must never show is call syntax)
    assert answer.message.content and "<tool_call>" not in answer.message.content
    assert_idle(engine)


def test_required_tool_call_streams_in_openai_deltas(client):
    # one call: offered more, this small model keeps calling until max_tokens
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(not d.content for d in deltas)  # nothing of the call syntax as content
    parts = [tc for d in deltas for tc in d.tool_calls or ()]
    assert parts[0].id and parts[0].type == "function" and parts[0].function.name in ("get_weather", "get_time")
    streamed = "".join(p.function.arguments or "" for p in parts)
    assert json.loads(streamed) == json.loads(full.choices[0].message.tool_calls[0].function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_tool_choice_with_the_streaming_helper(client):
    """auto: the grammar waits for the opener; whatever the model does, content has no syntax."""
    with client.beta.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER], parallel_tool_calls=False, max_tokens=60, temperature=0) as stream:
        for _ in stream:
            pass
        # the snapshot, not get_final_completion(): that refuses an answer cut at max_tokens
        message = stream.current_completion_snapshot.choices[0].message
    assert "<tool_call>" not in (message.content or "")
    for call in message.tool_calls or ():
        assert call.function.name == "get_weather" and set(_call_args(call)) == {"city", "unit"}


def test_tool_call_parser_splits_content_and_parallel_calls_at_any_chunking():
    text = 'Checking.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    for step in (1, 3, 7, len(text)):
        parser, content = ToolCallParser(), []
        for i in range(0, len(text), step):
            content.append(parser.feed(text[i : i + step])[0])
        content.append(parser.finish())
        assert "".join(content).strip() == "Checking." == parser.text
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("a", {"x": 1}), ("b", {})]
    # an opener cut off by max_tokens is dropped, never shown
    parser = ToolCallParser()
    assert parser.feed('Hi <tool_call>\n{"name": "a", "argu')[0] == "Hi " and parser.finish() == "" and not parser.calls


def test_history_with_calls_and_results_renders_in_the_documented_format():
    tools = parse_tools({"tools": [WEATHER]})
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}]},
        {"role": "tool", "content": "cold"},
    ]
    out = render_messages(messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\ncold\n</tool_response>"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER], "messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages[1].tool_call_id"),
        ({"n": 3}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": []}}}, "response_format.json_schema.schema"),
    ],
)
def test_bad_agent_input_is_a_400_naming_the_field_and_nothing_runs(base_url, engine, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, **extra}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert_idle(engine)


# ---------------------------------------------------------------- logprobs, n, seed


def test_logprobs_cover_every_token_streaming_or_not(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**args)
    entries = full.choices[0].logprobs.content
    assert len(entries) == full.usage.completion_tokens
    assert "".join(e.token for e in entries) == full.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        # greedy: the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # (compared with itself: the repeat reuses the cached prompt, and a different batch shape
    # may part the greedy answers at a near-tie)
    assert "".join(e.token for e in streamed) == text and len(streamed) == chunks[-1].usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in streamed)
    # requests that do not ask get none
    assert client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None


def test_legacy_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_logprobs_of_accepted_draft_tokens_match_plain_decoding(engine):
    """Speculation reports a log probability for every emitted token, drafted ones included."""
    text = "the quick brown fox jumps over the lazy dog"
    messages = [{"role": "user", "content": f"Repeat exactly, twice: {text} {text} {text}"}]
    results = {}
    for mode in ("off", "lookup"):
        req = ChatRequest(messages=messages, sampling=SamplingParams(temperature=0), max_tokens=40, speculative=mode, logprobs=1)
        results[mode] = engine.submit(req).result()
    off, spec = results["off"], results["lookup"]
    assert spec.metrics.accepted_tokens > 0
    assert len(spec.logprobs) == len(spec.token_ids) and len(off.logprobs) == len(off.token_ids)
    assert_same_or_near_tie(engine, messages, off.token_ids, spec.token_ids)
    same = next((i for i, (a, b) in enumerate(zip(off.token_ids, spec.token_ids, strict=False)) if a != b), min(len(off.token_ids), len(spec.token_ids)))
    for a, b in zip(off.logprobs[:same], spec.logprobs[:same], strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=0.05)


def test_n_choices_share_the_prompt_cells_and_take_distinct_seeds(client, engine):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Write a word."}], max_tokens=8, temperature=1.0, seed=7, n=2)
    out = client.chat.completions.create(**args)
    assert [c.index for c in out.choices] == [0, 1]
    again = client.chat.completions.create(**args)
    # the seed is honoured per choice
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    chunks = list(client.chat.completions.create(**args, stream=True))
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == out.choices[i].message.content
    assert_idle(engine)


def test_the_second_choice_takes_the_prompt_from_the_first(engine):
    prompt = [{"role": "user", "content": "Tell me about the sea. " * 20}]
    first = engine.submit(ChatRequest(messages=prompt, max_tokens=4))
    second = engine.submit(ChatRequest(messages=prompt, max_tokens=4, prompt_shared_with=first))
    a, b = first.result(60), second.result(60)
    # the prompt's cells and the logits after them: nothing to decode before its first token
    assert b.metrics.cached_tokens == b.metrics.prompt_tokens > 100
    assert a.metrics.prompt_tokens == b.metrics.prompt_tokens
    assert engine.kv_problems() == []


# ---------------------------------------------------------------- a second client library


def test_langchain_tool_round_trip_and_structured_output(base_url):
    """langchain-openai, as agent frameworks build on it: a bound tool, the result back in."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{base_url}/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=60, max_retries=0)
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke(messages)
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"} and "<tool_call>" not in ai.content
    messages += [ai, ToolMessage(content="21 C and sunny", tool_call_id=call["id"])]
    answer = llm.invoke(messages)
    assert answer.content and not answer.tool_calls

    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe a programmer.", max_tokens=150)
    assert isinstance(person, Person)


def _stream_lines(url: str, body: dict, headers: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_a_queued_stream_gets_keepalive_comments_before_its_first_chunk(engine):
    app = create_app(ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None, keepalive_s=0.1), engine)
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, "temperature": 0}
    with serving(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        expected = client.chat.completions.create(**body).choices[0].message.content

        def busy():
            # both sequences busy for a while: the streamed request waits in the engine's queue
            return [engine.submit(ChatRequest(messages=ASK, max_tokens=40, ignore_eos=True, speculative="off")) for _ in range(2)]

        held = busy()
        lines = _stream_lines(url, {**body, "stream": True}, {"Authorization": f"Bearer {KEY}"})
        for handle in held:
            assert handle.result(120).reason == "length"
        # the official client reads past the comments
        held = busy()
        chunks = list(client.chat.completions.create(**body, stream=True))
        for handle in held:
            handle.result(120)
    # comments only until the answer starts, then the whole answer
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data > 0 and all(line == ": keep-alive" for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"
    deltas = [json.loads(line[len("data: ") :])["choices"][0] for line in lines if line.startswith("data: {")]
    assert deltas[0]["delta"]["role"] == "assistant" and deltas[-1]["finish_reason"] == "length"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == expected
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert_idle(engine)
