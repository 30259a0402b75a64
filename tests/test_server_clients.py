"""What browser-based and ready-made clients need from `edgechat serve`: CORS, model aliases and
any model name, several listening addresses, llama-server's `grammar` and `json_schema` fields,
and an answer that ends at a repeated tool call; real SmolLM2 behind the real server."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from serving import serving

from edgechat.cli import cli
from edgechat.cli.common import run_guarded
from edgechat.engine import Engine, EngineConfig
from edgechat.engine.output.tools import ToolCallParser
from edgechat.server import ServerSettings, create_app, listen

KEY = "sk-clients"
MODEL = "smollm2-135m-instruct"
ALIAS = "gpt-4o-mini"
ORIGIN = "http://localhost:5173"
HI = [{"role": "user", "content": "Hi"}]
#: a function without arguments: a second call to it is the first one again
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now.", "parameters": {"type": "object", "properties": {}}}}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(models_root):
    eng = Engine(EngineConfig(model=MODEL, n_ctx=1024, n_parallel=2, max_queue=8, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_url(engine):
    settings = ServerSettings(api_key=KEY, model_id=MODEL, aliases=(ALIAS,), cors_origins=(ORIGIN,), degrade_queue_wait=None)
    with serving(create_app(settings, engine)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


# ---------------------------------------------------------------- CORS


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key(base_url):
    asked = "authorization, x-api-key, content-type"
    r = httpx.options(f"{base_url}/v1/chat/completions",
                      headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert {h.strip() for h in r.headers["access-control-allow-headers"].split(",")} >= {"authorization", "x-api-key", "content-type"}
    # the real request carries the header, and so does its refusal without a key (a page can read why)
    assert httpx.get(f"{base_url}/v1/models", headers={"Origin": ORIGIN, **_auth()}).headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.get(f"{base_url}/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_another_origin_gets_no_cors_headers(base_url):
    r = httpx.options(f"{base_url}/v1/messages", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403
    assert r.json()["type"] == "error" and "--cors-origins" in r.json()["error"]["message"]  # Anthropic's shape on its path
    assert not [h for h in r.headers if h.startswith("access-control-")]
    ok = httpx.get(f"{base_url}/v1/models", headers={"Origin": "http://evil.example", **_auth()})
    assert ok.status_code == 200 and not [h for h in ok.headers if h.startswith("access-control-")]


# ---------------------------------------------------------------- model names


def test_an_alias_answers_in_every_api_and_is_listed(client, base_url):
    assert [m.id for m in client.models.list()] == [MODEL, ALIAS]
    out = client.chat.completions.create(model=ALIAS, messages=HI, max_tokens=2, temperature=0)
    assert out.choices[0].message.content and out.model == MODEL
    anthropic = httpx.post(f"{base_url}/v1/messages", headers={"x-api-key": KEY},
                           json={"model": ALIAS.upper(), "max_tokens": 2, "messages": HI}, timeout=120)
    assert anthropic.status_code == 200, anthropic.text
    ollama = httpx.post(f"{base_url}/api/chat", headers=_auth(),
                        json={"model": ALIAS, "messages": HI, "stream": False, "options": {"num_predict": 2}}, timeout=120)
    assert ollama.status_code == 200 and ollama.json()["done"], ollama.text
    tags = httpx.get(f"{base_url}/api/tags", headers=_auth()).json()["models"]
    assert [m["name"] for m in tags] == [f"{MODEL}:latest", f"{ALIAS}:latest"]
    # without --any-model-name an unknown name stays a 404, in each API's shape
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=HI, max_tokens=2)
    missing = httpx.post(f"{base_url}/v1/messages", headers={"x-api-key": KEY}, json={"model": "claude-x", "max_tokens": 2, "messages": HI})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert httpx.post(f"{base_url}/api/chat", headers=_auth(), json={"model": "llama3", "messages": HI}).status_code == 404


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _serving_on(app, hosts: list[str]):
    """The app on every host at one port, as `edgechat serve --host A,B` runs it."""
    sockets = listen.bind(hosts, 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        for s in sockets:
            s.close()


def test_any_model_name_is_served_by_the_model_on_every_address(engine):
    hosts = ["127.0.0.1", "::1"] if _has_ipv6_loopback() else ["127.0.0.1"]
    app = create_app(ServerSettings(model_id=MODEL, any_model_name=True, degrade_queue_wait=None), engine)
    with _serving_on(app, hosts) as port:
        for host in hosts:
            url = f"http://{listen.url_host(host)}:{port}"
            out = httpx.post(f"{url}/v1/chat/completions", json={"model": "gpt-4", "messages": HI, "max_tokens": 2, "temperature": 0}, timeout=120)
            assert out.status_code == 200 and out.json()["model"] == MODEL, out.text
            assert httpx.get(f"{url}/v1/models/gpt-4").json()["id"] == MODEL


def test_serve_reports_bad_addresses_and_options_in_one_line(capsys):
    for args, says in ((["--host", "192.0.2.1"], "cannot listen on 192.0.2.1"), (["--host", "127.0.0.1,,::1"], "--host wants"),
                       (["--cors-origins", "localhost"], "--cors-origins"), (["--alias", " "], "alias must not be empty")):
        with pytest.raises(SystemExit) as info:
            run_guarded(cli, ["serve", "--port", "0", *args])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert info.value.code == 2 and len(lines) == 1 and says in lines[0], lines


# ---------------------------------------------------------------- grammar and json_schema


def test_grammar_and_json_schema_fields_hold_the_answer(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=4, temperature=0,
                                         extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert out.choices[0].message.content in ("yes", "no")
    schema = {"type": "object", "properties": {"wet": {"type": "boolean"}}, "required": ["wet"], "additionalProperties": False}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet? Answer in JSON."}], max_tokens=20,
                                         temperature=0, extra_body={"json_schema": schema})
    assert isinstance(json.loads(out.choices[0].message.content)["wet"], bool)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"grammar": 'root ::= "yes'}, "grammar"),
        ({"grammar": "answer ::= [a-z]+"}, "grammar"),  # no root
        ({"grammar": 'root ::= "a"{2,1}'}, "grammar"),  # llama.cpp's parser would hang on it
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
        ({"json_schema": {"type": "object"}, "tools": [CLOCK]}, "json_schema"),
        ({"json_schema": {"type": "object", "minProperties": 1}}, "json_schema"),
    ],
)
def test_a_bad_or_conflicting_grammar_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body=extra)
    assert info.value.body["param"].startswith(param)


# ---------------------------------------------------------------- a repeated tool call


def test_the_parser_ends_the_calls_at_a_repeated_one():
    call = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
    other = '<tool_call>\n{"name": "a", "arguments": {"x": 2}}\n</tool_call>'
    parser = ToolCallParser()
    text = "\n".join([call, other, call.replace('"x": 1', '"x":1'), other])
    for i in range(0, len(text), 7):
        parser.feed(text[i : i + 7])
    assert parser.finish() == "" and parser.ended
    assert [json.loads(c.arguments) for c in parser.calls] == [{"x": 1}, {"x": 2}]


def test_a_forced_call_that_repeats_ends_the_streamed_answer(client):
    """SmolLM2 made to call (parallel calls on, as by default) writes the same call again and
    again; the answer ends at the first repeat, which is not returned."""
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What time is it?"}], tools=[CLOCK],
                                            tool_choice="required", max_tokens=200, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert {c.index for c in calls} == {0} and [c.function.name for c in calls if c.function.name] == ["get_time"]
    assert reasons == ["tool_calls"]
    # a call and its repeat (about 30 tokens each, a few more where a batch-mate's numerics change
    # the arguments' words), far from the cap of 200 that eight calls would run into
    assert chunks[-1].usage.completion_tokens < 100
