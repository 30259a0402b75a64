"""One stream path for every API: keep-alive while queued (llama-server's /completion too), the
same tool calls streamed and whole through chat completions, Responses, Anthropic Messages and
Ollama's /api/chat (the official clients), an Ollama conversation with its calls and results
prompted as chat completions prompts it, a client that leaves mid-answer freeing its sequence on
every API, and the server package's shape (no tool-call parser outside the engine, no import
circle)."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from serving import serving

from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.server import ServerSettings, create_app
from edgechat.server.tools import parse_tools

KEY = "sk-test-key"
MODEL = "smollm2-135m-instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather now in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
PACKAGE = Path(__file__).resolve().parents[1] / "edgechat"


@pytest.fixture(scope="module")
def engine(models_root):
    # one sequence: a second request waits in the engine's queue until the first ends
    eng = Engine(EngineConfig(model=MODEL, n_ctx=2048, n_parallel=1, max_queue=8, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_url(engine):
    settings = ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None, keepalive_s=0.1)
    with serving(create_app(settings, engine)) as url:
        yield url


def _wait_idle(engine, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while engine.stats()["running"] or engine.stats()["waiting"]:
        assert time.monotonic() < deadline, f"the engine is still busy: {engine.stats()}"
        time.sleep(0.05)
    assert engine.kv_problems() == []


# ---------------------------------------------------------------- keep-alive while queued


def _data_lines(lines: list[str]) -> list[dict]:
    """What llama.cpp's own test client reads of a stream: the `data: ` lines, every other
    line (comments among them) skipped."""
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ") and "[DONE]" not in line]


def test_a_queued_completion_stream_gets_keepalive_bytes_before_its_first_token(engine, base_url):
    body = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0}
    whole = httpx.post(f"{base_url}/completion", json=body, headers=AUTH, timeout=120).json()
    # the one sequence busy for a while: the streamed request waits in the engine's queue
    held = engine.submit(ChatRequest(messages=ASK, max_tokens=60, ignore_eos=True, speculative="off"))
    with httpx.stream("POST", f"{base_url}/completion", json={**body, "stream": True}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert held.result(120).reason == "length"
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data > 0 and all(line.startswith(":") for line in lines[:first_data])
    events = _data_lines(lines)
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    _wait_idle(engine)


# ---------------------------------------------------------------- the same calls on every API


def _chat_calls(client: openai.OpenAI, model: str, choice: str, stream: bool) -> list[tuple[str, dict]]:
    args = {"model": model, "messages": ASK, "tools": [{"type": "function", "function": WEATHER}], "tool_choice": choice,
            "max_tokens": 80, "temperature": 0}
    if not stream:
        message = client.chat.completions.create(**args).choices[0].message
        return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or "" if delta.function else ""
            entry[1] += delta.function.arguments or "" if delta.function else ""
    return [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]


def _responses_calls(client: openai.OpenAI, model: str, choice: str, stream: bool) -> list[tuple[str, dict]]:
    args = {"model": model, "input": ASK, "tools": [{"type": "function", **WEATHER}], "tool_choice": choice,
            "max_output_tokens": 80, "temperature": 0}
    if stream:
        done = [e for e in client.responses.create(**args, stream=True) if e.type == "response.completed"]
        output = done[0].response.output
    else:
        output = client.responses.create(**args).output
    return [(item.name, json.loads(item.arguments)) for item in output if item.type == "function_call"]


def _messages_calls(client: anthropic.Anthropic, model: str, choice: str, stream: bool) -> list[tuple[str, dict]]:
    tool_choice = {"type": {"required": "any"}.get(choice, choice)}
    # the installed client's signature leaves temperature out: it goes in the body as it is
    args = {"model": model, "messages": ASK, "max_tokens": 80, "extra_body": {"temperature": 0}, "tool_choice": tool_choice,
            "tools": [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]}
    if stream:
        with client.messages.stream(**args) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**args)
    return [(block.name, block.input) for block in message.content if block.type == "tool_use"]


def _ollama_calls(client: ollama.Client, model: str, stream: bool) -> list[tuple[str, dict]]:
    args = {"model": model, "messages": ASK, "tools": [{"type": "function", "function": WEATHER}],
            "options": {"temperature": 0, "num_predict": 80}}
    if stream:
        chunks = list(client.chat(**args, stream=True))
        assert chunks[-1].done and chunks[-1].done_reason == "stop"
        calls = [c for chunk in chunks for c in chunk.message.tool_calls or ()]
    else:
        answer = client.chat(**args)
        assert answer.done_reason == "stop"
        calls = list(answer.message.tool_calls or ())
    return [(c.function.name, dict(c.function.arguments)) for c in calls]


def _calls_on_every_api(url: str, model: str, choice: str) -> dict[str, list[tuple[str, dict]]]:
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    out = {}
    for stream in (False, True):
        out[f"chat stream={stream}"] = _chat_calls(chat, model, choice, stream)
        out[f"responses stream={stream}"] = _responses_calls(chat, model, choice, stream)
        out[f"messages stream={stream}"] = _messages_calls(messages, model, choice, stream)
        if choice == "auto":  # Ollama's API has no tool_choice: the model calls or answers
            out[f"ollama stream={stream}"] = _ollama_calls(ollama.Client(host=url, headers=AUTH, timeout=120), model, stream)
    return out


def test_a_required_call_is_the_same_on_every_api_streamed_and_whole(engine, base_url):
    got = _calls_on_every_api(base_url, MODEL, "required")
    first = got["chat stream=False"]
    assert first and first[0][0] == "get_weather" and isinstance(first[0][1].get("city"), str)
    assert all(calls == first for calls in got.values()), got
    _wait_idle(engine)


@pytest.fixture(scope="module")
def qwen(qwen_coder_path, models_root):
    eng = Engine(EngineConfig(model=str(qwen_coder_path), n_ctx=2048, n_parallel=1, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def qwen_url(qwen):
    with serving(create_app(ServerSettings(api_key=KEY, model_id="qwen", degrade_queue_wait=None), qwen)) as url:
        yield url


def test_the_real_model_calls_its_tool_the_same_way_on_every_api(qwen, qwen_url):
    got = _calls_on_every_api(qwen_url, "qwen", "auto")
    first = got["chat stream=False"]
    assert [name for name, _ in first] == ["get_weather"] and "paris" in first[0][1]["city"].lower()
    assert all(calls == first for calls in got.values()), got
    _wait_idle(qwen)


def test_ollamas_calls_come_as_ollama_writes_them(qwen_url):
    body = {"model": "qwen", "messages": ASK, "tools": [{"type": "function", "function": WEATHER}], "options": {"temperature": 0}}
    whole = httpx.post(f"{qwen_url}/api/chat", json={**body, "stream": False}, headers=AUTH, timeout=120).json()
    [call] = whole["message"]["tool_calls"]
    # an id and the call's place in the answer beside the name, the arguments an object
    assert call["id"].startswith("call_") and call["function"]["index"] == 0 and isinstance(call["function"]["arguments"], dict)
    assert whole["message"]["content"] == "" and whole["done_reason"] == "stop"
    with httpx.stream("POST", f"{qwen_url}/api/chat", json=body, headers=AUTH, timeout=120) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    with_calls = [line for line in lines if line["message"].get("tool_calls")]
    assert len(with_calls) == 1 and not with_calls[0]["done"] and lines[-1]["done"] and "tool_calls" not in lines[-1]["message"]
    assert [c["function"] for c in with_calls[0]["message"]["tool_calls"]] == [call["function"]]
    assert "".join(line["message"]["content"] for line in lines) == ""


#: a conversation as far as the tool's result: the user's question, the model's call, the result
HISTORY_OPENAI = ASK + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "11 degrees celsius, light rain"},
]
#: the same as Ollama's clients send it: arguments an object, no ids, the result naming its tool
HISTORY_OLLAMA = ASK + [
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_name": "get_weather", "content": "11 degrees celsius, light rain"},
]


#: WEATHER as the ollama client sends it: it keeps only the schema keys it models (type,
#: description, enum, items), `required` first
PLAIN_WEATHER = {**WEATHER, "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}


def test_an_ollama_conversation_with_its_calls_and_results_is_prompted_as_chat_completions_prompts_it(qwen, qwen_url):
    tools = [{"type": "function", "function": PLAIN_WEATHER}]
    chat = openai.OpenAI(base_url=f"{qwen_url}/v1", api_key=KEY, max_retries=0, timeout=120).chat.completions.create(
        model="qwen", messages=HISTORY_OPENAI, tools=tools, temperature=0, max_tokens=40)
    client = ollama.Client(host=qwen_url, headers=AUTH, timeout=120)
    answer = client.chat(model="qwen", messages=HISTORY_OLLAMA, tools=tools, options={"temperature": 0, "num_predict": 40})
    # the same prompt (the call and its result rendered by the model's template), so the same answer
    assert answer.prompt_eval_count == chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens > qwen.count_tokens(ChatRequest(messages=ASK, tools=parse_tools({"tools": tools}))) + 10
    message = chat.choices[0].message
    assert (answer.message.content or "") == (message.content or "")
    assert [(c.function.name, dict(c.function.arguments)) for c in answer.message.tool_calls or ()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]
    # a result that answers no earlier call is refused in Ollama's shape, naming the message
    stray = ASK + [{"role": "tool", "tool_name": "get_weather", "content": "11"}]
    r = httpx.post(f"{qwen_url}/api/chat", json={"model": "qwen", "messages": stray, "tools": tools}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and set(r.json()) == {"error"} and "messages[1]" in r.json()["error"]
    _wait_idle(qwen)


# ---------------------------------------------------------------- a client that leaves


LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
#: each streaming endpoint and a body that answers at length
STREAMS = {
    "/v1/chat/completions": {"model": MODEL, "messages": ASK, **LONG},
    "/v1/completions": {"model": MODEL, "prompt": "Once upon a time", **LONG},
    "/v1/responses": {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 400, "temperature": 0},
    "/v1/messages": {"model": MODEL, "messages": ASK, "max_tokens": 400, "temperature": 0},
    "/api/chat": {"model": MODEL, "messages": ASK, "options": {"num_predict": 400, "temperature": 0}},
    "/api/generate": {"model": MODEL, "prompt": "Once upon a time", "options": {"num_predict": 400, "temperature": 0}},
    "/completion": {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "temperature": 0},
}


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_client_that_leaves_mid_answer_frees_its_sequence(engine, base_url, path):
    _wait_idle(engine)
    with httpx.stream("POST", f"{base_url}{path}", json={**STREAMS[path], "stream": True}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            # a few chunks of the answer, then the client hangs up
            seen += line.startswith(("data:", "{"))
            if seen >= 4:
                break
        assert seen >= 4
        assert engine.stats()["running"] == 1
    _wait_idle(engine, within=10)


# ---------------------------------------------------------------- the package's shape


def _modules(folder: Path):
    for path in sorted(folder.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def test_no_module_outside_the_engine_builds_a_tool_call_parser():
    found = []
    for path, tree in _modules(PACKAGE):
        if PACKAGE / "engine" in path.parents:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ToolCallParser":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


def _server_imports() -> dict[str, set[str]]:
    """Each server module's imports of other server modules (TYPE_CHECKING and lazy ones too)."""
    graph: dict[str, set[str]] = {}
    for path, tree in _modules(PACKAGE / "server"):
        name = path.stem
        graph[name] = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                parts = target.split(".")
                if parts[:2] == ["edgechat", "server"] and len(parts) > 2 and (PACKAGE / "server" / f"{parts[2]}.py").is_file():
                    if parts[2] != name:
                        graph[name].add(parts[2])
    return graph


def test_the_server_package_has_no_import_circle():
    graph = _server_imports()
    circles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    assert circles == []


def test_the_dispatcher_imports_no_api_and_no_module_reaches_into_anothers_privates():
    graph = _server_imports()
    apis = {name for name in graph if name.endswith("_api")}
    assert "dispatch" in graph and not graph["dispatch"] & apis
    private = []
    for path, tree in _modules(PACKAGE / "server"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgechat.server"):
                private += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []
