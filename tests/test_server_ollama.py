"""Ollama's API on `edgechat serve`: the official `ollama` client against a real engine on SmolLM2."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import ollama
import openai
import pytest
from serving import serving
from test_hub import TEST_REPO, fake_hub  # noqa: F401  (fake_hub: the stand-in Hub fixture)
from test_tui_pull import online  # noqa: F401  (this process online, against the stand-in Hub)

from edgechat.engine import Engine, EngineConfig
from edgechat.models import hub, resolve_model
from edgechat.server import ServerSettings, create_app

KEY = "sk-test-key"
MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0, "seed": 1, "num_predict": 12}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(models_root):
    eng = Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=2, max_queue=2, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_url(engine):
    settings = ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None)
    with serving(create_app(settings, engine)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return ollama.Client(host=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_chat_streamed_and_not_give_the_openai_endpoints_greedy_answer(client, base_url):
    whole = client.chat(model=MODEL, messages=HI, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.message.content and 0 < whole.eval_count <= 12 and whole.prompt_eval_count > 5
    assert whole.total_duration > 0 and whole.eval_duration > 0

    parts = list(client.chat(model=MODEL, messages=HI, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == whole.done_reason and parts[-1].eval_count == whole.eval_count

    oa = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    same = oa.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0, seed=1)
    assert same.choices[0].message.content == whole.message.content


def test_generate_answers_as_chat_does_and_raw_takes_the_prompt_as_is(client):
    out = client.generate(model=MODEL, prompt="Say hello.", options=GREEDY)
    chat = client.chat(model=MODEL, messages=HI, options=GREEDY)
    assert out.done and out.response == chat.message.content
    streamed = "".join(p.response for p in client.generate(model=MODEL, prompt="Say hello.", options=GREEDY, stream=True))
    assert streamed == out.response
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options={**GREEDY, "num_predict": 4})
    assert raw.response and raw.eval_count <= 4
    # an empty prompt is how clients load a model
    assert client.generate(model=MODEL).done_reason == "load"


def test_format_json_gives_valid_json(client):
    ask = [{"role": "user", "content": "List three colours."}]
    out = client.chat(model=MODEL, messages=ask, format="json", options={"temperature": 0, "num_predict": 80})
    assert out.done_reason == "stop" and isinstance(json.loads(out.message.content), dict)
    colours = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
               "required": ["colours"]}
    streamed = "".join(p.message.content for p in client.chat(model=MODEL, messages=ask, format=colours, stream=True,
                                                              options={"temperature": 0, "num_predict": 80}))
    assert list(json.loads(streamed)) == ["colours"]


def test_list_show_ps_and_version_describe_the_served_model(client, base_url, engine):
    models = client.list().models
    assert [m.model for m in models] == [f"{MODEL}:latest"]
    m = models[0]
    assert m.size == engine.model_info.size_bytes and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family == engine.model_info.architecture
    assert m.details.parameter_size.endswith("M") and m.details.quantization_level == engine.model_info.quant

    shown = client.show(f"{MODEL}:latest")
    assert shown.details.family == engine.model_info.architecture and "completion" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == engine.model_info.architecture
    assert shown.template == engine.format.source
    assert client.show(MODEL).details == shown.details  # the name without its tag

    assert [p.model for p in client.ps().models] == [f"{MODEL}:latest"]
    assert httpx.get(f"{base_url}/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()["version"]


def test_bad_input_gets_ollamas_error_shape(client, base_url):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="llama3:8b", messages=HI)
    assert info.value.status_code == 404 and "llama3:8b" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=HI, options={"temperature": "warm"})
    assert info.value.status_code == 400 and "temperature" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert info.value.status_code == 400 and "images" in info.value.error

    auth = {"Authorization": f"Bearer {KEY}"}
    for r in (
        httpx.get(f"{base_url}/api/tags"),  # no key
        httpx.post(f"{base_url}/api/chat", content=b"{", headers=auth),
        httpx.post(f"{base_url}/api/chat", content=b"x" * (9 << 20), headers=auth),
        httpx.get(f"{base_url}/api/chat", headers=auth),
        httpx.post(f"{base_url}/api/chat", json={"model": MODEL, "messages": HI, "think": "hard"}, headers=auth),
    ):
        assert 400 <= r.status_code < 500 and set(r.json()) == {"error"} and isinstance(r.json()["error"], str), r.text
    assert [r.status_code for r in (httpx.get(f"{base_url}/api/tags"),)] == [401]


def test_full_queue_and_disconnect_keep_the_servers_properties(client, base_url, engine):
    def one(_):
        try:
            client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 24})
            return 200, None
        except ollama.ResponseError as exc:
            return exc.status_code, exc.error

    # 2 sequences and 2 places in the queue: the rest are refused at once, in Ollama's shape
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert sum(s == 200 for s, _ in results) >= 2 and any(s == 429 for s, _ in results), results
    assert all(s in (200, 429) and (s == 200 or "capacity" in e) for s, e in results)

    # a client leaving mid-stream frees its sequence
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "raw": True, "options": {"num_predict": 400}}
    with httpx.stream("POST", f"{base_url}/api/generate", json=body, headers=auth, timeout=60) as r:
        assert json.loads(next(r.iter_lines()))["done"] is False
    assert wait_idle(engine)["running"] == 0
    assert engine.kv_problems() == []


def wait_idle(engine, timeout=5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_pull_streams_progress_into_the_cache_and_a_model_here_asks_the_hub_nothing(isolated_dirs, online, smollm2_path):  # noqa: F811
    ref = f"{TEST_REPO}:Q4_1"
    with Engine(EngineConfig(model=MODEL, n_ctx=256, paths=isolated_dirs)) as engine:
        with serving(create_app(ServerSettings(api_key=KEY, model_id=MODEL), engine)) as url:
            client = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            lines = list(client.pull(ref, stream=True))
            assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
            progress = [line.completed for line in lines if line.total]
            assert progress == sorted(progress) and progress[-1] == lines[-2].total == smollm2_path.stat().st_size
            assert resolve_model(ref, isolated_dirs).is_relative_to(hub.hub_cache(isolated_dirs))
            seen = len(online.requests)
            assert client.pull(ref).status == "success" and len(online.requests) == seen
            # what the Hub does not have, streamed or not; what is not a reference at all
            for stream in (False, True):
                with pytest.raises(ollama.ResponseError, match="no Hub repository nobody/nothing-GGUF") as missing:
                    result = client.pull("nobody/nothing-GGUF:Q4_K_M", stream=stream)
                    list(result) if stream else None
                assert missing.value.status_code == (-1 if stream else 404)
            with pytest.raises(ollama.ResponseError, match="neither a catalog name nor a Hub reference") as bad:
                client.pull("no such thing")
            assert bad.value.status_code == 400
