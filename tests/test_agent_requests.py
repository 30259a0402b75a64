"""What coding agents send, accepted as the hosted APIs accept it: every JSON Schema keyword in a
tool's parameters (enforced where the grammar can, left to the tool where not), Responses'
namespace, custom and hosted tools, Anthropic's mid-conversation system messages and hosted
tools, and the context-exceeded error each agent acts on. Real engine, real SmolLM2, the
official clients."""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import jsonschema
import openai
import pytest
from serving import serving

from edgechat.engine import Engine, EngineConfig
from edgechat.engine.output import schema_grammar
from edgechat.engine.output.schema_grammar import check_schema, schema_rules, tool_schema
from edgechat.errors import InvalidFieldError
from edgechat.models import resolve_model
from edgechat.models.ggufinfo import read_model_info
from edgechat.models.planner import DEFAULT_CTX_CAP, choose_context
from edgechat.server import ServerSettings, create_app

KEY = "sk-test-key"
MODEL = "smollm2-135m-instruct"
N_CTX = 1024

#: parameters as agents write them: bounds, propertyNames, an unknown format, an unanchored
#: pattern, a boolean schema, a property that only describes itself
AGENT_PARAMS = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "path": {"type": "string", "description": "The file to read", "pattern": "[^/]$"},
        "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
        "limit": {"type": "integer", "exclusiveMinimum": 0},
        "url": {"type": "string", "format": "uri"},
        "meta": {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": True},
        "args": {"description": "any value the script reads"},
        "anything": True,
    },
    "required": ["path"],
    "additionalProperties": False,
}
#: the tool a forced call is made to: the same keywords, no free-form values (a 135M model
#: writes those on and on)
CALL_PARAMS = {**AGENT_PARAMS, "properties": {k: v for k, v in AGENT_PARAMS["properties"].items() if k in ("path", "offset", "limit")}}
#: the keywords the grammar cannot hold in AGENT_PARAMS
NOT_ENFORCED = {"'minimum'", "'maximum'", "'exclusiveMinimum'", "'propertyNames'", "'uri'", "'pattern'", "boolean schema true"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(models_root):
    eng = Engine(EngineConfig(model=MODEL, n_ctx=N_CTX, max_queue=4, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_url(engine):
    with serving(create_app(ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None), engine)) as url:
        yield url


@pytest.fixture
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)


# ---- the schema walk -------------------------------------------------------------------------


def test_a_tool_schema_keeps_what_the_grammar_enforces_and_leaves_out_the_rest(caplog):
    caplog.set_level(logging.INFO, "edgechat.tools")
    schema_grammar._log_unenforced.cache_clear()  # logged once per process: this test reads it
    enforced = tool_schema(AGENT_PARAMS, "tools[0].parameters")
    props = enforced["properties"]
    assert props["path"] == {"type": "string", "description": "The file to read"}
    assert props["offset"] == {"type": "integer"} and props["limit"] == {"type": "integer"}
    assert props["url"] == {"type": "string"} and props["meta"] == {"type": "object", "additionalProperties": True}
    # no constraint left: any JSON value, not the converter's reading of {} as an object
    assert set(props["args"]["type"]) == {"object", "array", "string", "number", "boolean", "null"}
    assert enforced["required"] == ["path"] and enforced["additionalProperties"] is False
    assert AGENT_PARAMS["properties"]["offset"]["minimum"] == 0  # the caller's schema is untouched
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(k in logged for k in NOT_ENFORCED), logged
    # the grammar builds, and a structured-output schema with the same keywords is still refused
    assert "root ::=" in schema_rules([("", enforced)], "x")
    with pytest.raises(InvalidFieldError, match="cannot be enforced"):
        check_schema(AGENT_PARAMS, "response_format.json_schema.schema")


def test_a_length_bound_past_what_a_grammar_holds_is_left_to_the_tool_or_refused():
    # Claude Code's Workflow tool: a script of up to 512 KiB; the converter writes a bound as
    # that many nested optional characters (megabytes of grammar, past llama.cpp's stack)
    script = {"type": "object", "properties": {"script": {"type": "string", "maxLength": 524288}, "note": {"type": "string", "maxLength": 200}}}
    enforced = tool_schema(script, "tools[0].parameters")
    assert enforced["properties"] == {"script": {"type": "string"}, "note": {"type": "string", "maxLength": 200}}
    assert len(schema_rules([("", enforced)], "x")) < 10_000
    with pytest.raises(InvalidFieldError, match="'maxLength' above"):
        check_schema(script, "response_format.json_schema.schema")


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "properties": {"a": {"type": "strange"}}}, "unknown type"),
    ({"type": "object", "properties": {"a": {"anyOf": {"type": "string"}}}}, "must be a non-empty list"),
    ({"type": "object", "properties": {"a": 5}}, "must be an object"),
    ({"type": "object", "properties": []}, "'properties'"),
])
def test_a_malformed_tool_schema_is_still_refused(schema, where):
    with pytest.raises(InvalidFieldError, match=where):
        tool_schema(schema, "tools[0].parameters")


def test_with_no_ctx_a_server_plans_the_trained_window_and_a_chat_the_cap(models_root):
    info = read_model_info(resolve_model(MODEL, models_root))
    assert info.context_length > DEFAULT_CTX_CAP
    assert choose_context(info, cap=None, n_seq=4).n_ctx == info.context_length
    assert choose_context(info).n_ctx == DEFAULT_CTX_CAP
    # where memory does not hold it, the largest window that fits
    assert choose_context(info, cap=None, available=200 << 20).n_ctx < info.context_length


# ---- each API takes the agents' tools --------------------------------------------------------


def test_chat_completions_accept_agent_schemas_and_the_call_holds_the_enforced_part(oai, engine):
    tool = {"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": CALL_PARAMS}}
    answer = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Read the file notes.txt"}], tools=[tool],
        tool_choice="required", max_tokens=120, temperature=0)
    (call,) = answer.choices[0].message.tool_calls[:1]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool_schema(CALL_PARAMS, "x"))
    assert call.function.name == "read" and isinstance(args["path"], str)


def test_messages_accept_agent_schemas_hosted_tools_and_claude_code_fields(claude):
    answer = claude.messages.create(
        model=MODEL, max_tokens=300,
        system=[{"type": "text", "text": "You help with code.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Read the file notes.txt"},
                  {"role": "system", "content": "The agent types are: explore, plan."},
                  {"role": "user", "content": "Go on."}],
        tools=[{"name": "Read", "description": "Read a file", "input_schema": CALL_PARAMS},
               {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        tool_choice={"type": "any"},
        extra_body={"thinking": {"type": "adaptive"}, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                    "output_config": {"effort": "high"}, "metadata": {"user_id": "{\"session_id\": \"x\"}"}, "temperature": 0},
    )
    (use,) = [b for b in answer.content if b.type == "tool_use"][:1] or [answer]
    assert answer.stop_reason == "tool_use" and use.name == "Read"
    jsonschema.validate(use.input, tool_schema(CALL_PARAMS, "x"))


def test_a_mid_conversation_system_message_is_in_the_prompt_where_it_stands(base_url, engine):
    body = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "system", "content": "SENTINEL-RULE"}, {"role": "user", "content": "Go on."}]}
    counted = httpx.post(f"{base_url}/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY}, timeout=60)
    without = httpx.post(f"{base_url}/v1/messages/count_tokens", headers={"x-api-key": KEY}, timeout=60,
                         json={**body, "messages": [body["messages"][0], body["messages"][2]]})
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > without.json()["input_tokens"]


def _responses(base_url: str, body: dict) -> dict:
    r = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


NAMESPACE = {"type": "namespace", "name": "files", "description": "File tools", "tools": [
    {"type": "function", "name": "read_file", "description": "Read a file", "strict": False, "parameters": CALL_PARAMS}]}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}


def test_responses_namespace_tools_are_called_under_their_namespace(oai):
    answer = oai.responses.create(model=MODEL, input="Read notes.txt", tools=[NAMESPACE, {"type": "web_search", "external_web_access": False}],
                                  tool_choice={"type": "function", "name": "read_file"}, max_output_tokens=120, temperature=0)
    (call,) = [i for i in answer.output if i.type == "function_call"]
    data = call.model_dump()
    assert (data["name"], data.get("namespace")) == ("read_file", "files")
    jsonschema.validate(json.loads(call.arguments), tool_schema(CALL_PARAMS, "x"))
    # the tools echo as sent, the hosted one too
    assert [t.type for t in answer.tools] == ["namespace", "web_search"]


def test_responses_custom_tools_are_called_with_free_text_and_their_output_goes_back(base_url):
    first = _responses(base_url, {"input": "Change the greeting in hello.py to 'hi'", "tools": [PATCH],
                                  "tool_choice": {"type": "custom", "name": "apply_patch"}, "max_output_tokens": 80, "temperature": 0})
    (call,) = [i for i in first["output"] if i["type"] == "custom_tool_call"]
    assert call["name"] == "apply_patch" and isinstance(call["input"], str) and call["input"]
    assert not call["input"].lstrip().startswith('{"input"')  # the text itself, not the JSON it was offered as
    # the agent's next request: the call, its output, a hosted tool's call item, a reasoning item
    follow = _responses(base_url, {"tools": [PATCH], "max_output_tokens": 20, "temperature": 0, "input": [
        {"type": "message", "role": "user", "content": "Change the greeting in hello.py to 'hi'"},
        {"type": "reasoning", "summary": [], "encrypted_content": None},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "x"}},
        {k: call[k] for k in ("type", "call_id", "name", "input")},
        {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done: hello.py updated"}]})
    assert follow["status"] in ("completed", "incomplete") and follow["output"]


def test_streamed_custom_call_events_parse_in_the_official_client(oai):
    events = list(oai.responses.create(model=MODEL, input="Change hello.py", tools=[PATCH], stream=True,
                                       tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=60, temperature=0))
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds, kinds
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[-1].type == "custom_tool_call" and done[-1].input
    assert events[-1].type in ("response.completed", "response.incomplete")


# ---- the context-exceeded error each agent acts on -------------------------------------------


LONG = "word " * (N_CTX * 2)


def test_a_prompt_over_the_window_is_each_apis_own_context_error(oai, claude, engine):
    with pytest.raises(openai.BadRequestError) as chat:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=10)
    assert chat.value.code == "context_length_exceeded" and "maximum context length" in chat.value.message
    with pytest.raises(openai.BadRequestError) as resp:
        oai.responses.create(model=MODEL, input=LONG, max_output_tokens=10)
    assert resp.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as msgs:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": LONG}])
    body = msgs.value.body["error"]
    # Claude Code reads these numbers to compact its conversation
    assert body["type"] == "invalid_request_error"
    prompt, limit = (int(x) for x in body["message"].removeprefix("prompt is too long: ").removesuffix(" maximum").split(" tokens > "))
    assert prompt > limit and limit <= N_CTX
