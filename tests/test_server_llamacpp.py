"""llama-server's own endpoints on `edgechat serve`, against a real engine on SmolLM2."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serving import serving

from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.models.planner import default_threads
from edgechat.server import ServerSettings, create_app

KEY = "sk-test-key"
MODEL = "smollm2-135m-instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "Say hello."}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(models_root):
    eng = Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=2, max_queue=2, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def http(engine):
    settings = ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None)
    with serving(create_app(settings, engine)) as url:
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
            yield client


def test_tokenize_and_detokenize_round_trip(http, engine):
    text = "Hello, world! Ünïcode too."
    tokens = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert tokens == engine.tokenize(text)
    assert http.post("/detokenize", json={"tokens": tokens}).json()["content"] == text
    pieces = http.post("/tokenize", json={"content": "Hello, world!", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens[:len(pieces)] and "".join(p["piece"] for p in pieces) == "Hello, world!"
    # special tokens are parsed, as in a prompt
    assert len(http.post("/tokenize", json={"content": "<|im_start|>"}).json()["tokens"]) == 1


def test_apply_template_gives_the_engines_prompt(http, engine):
    messages = [{"role": "system", "content": "Be brief."}, *HI]
    prompt = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    assert "Say hello." in prompt
    assert engine.prompt_text_tokens(prompt) == engine.prompt_tokens(ChatRequest(messages=messages))


def test_completion_streamed_equals_whole(http):
    body = {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0}
    whole = http.post("/completion", json=body).json()
    assert whole["stop"] and whole["content"] and 0 < whole["tokens_predicted"] <= 8
    assert whole["tokens_evaluated"] > 3 and whole["stop_type"] in ("eos", "limit", "word")
    with http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]
    # the same greedy text as the OpenAI legacy endpoint
    legacy = http.post("/v1/completions", json={"prompt": body["prompt"], "max_tokens": 8, "temperature": 0}).json()
    assert legacy["choices"][0]["text"] == whole["content"]


def test_props_describe_the_server(http, engine):
    props = http.get("/props").json()
    assert props["total_slots"] == 2 and props["n_ctx"] == engine.n_ctx
    assert props["default_generation_settings"]["n_ctx"] == engine.n_ctx
    assert "temperature" in props["default_generation_settings"]["params"]
    assert props["model_path"] == str(engine.model_info.path) and props["chat_template"] == engine.format.source


def test_unprefixed_openai_routes_answer(http):
    client = openai.OpenAI(base_url=str(http.base_url), api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0)
    assert chat.choices[0].message.content
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_openai_answers_and_chunks_carry_the_system_fingerprint(http):
    client = openai.OpenAI(base_url=str(http.base_url), api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0)
    fingerprint = chat.system_fingerprint
    # llama-server's shape ("b" and the build), which llama.cpp's own tests check
    assert fingerprint and fingerprint.startswith("b")
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).system_fingerprint == fingerprint
    for path, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "Hi"})):
        body = {**body, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", path, json=body) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert len(chunks) > 2 and all(c["system_fingerprint"] == fingerprint for c in chunks), path


def test_errors_in_llama_servers_shape(http):
    for r in (
        http.get("/props", headers={"Authorization": "Bearer wrong"}),
        http.post("/detokenize", json={"tokens": [10**9]}),  # outside the vocabulary
        http.post("/completion", json={"prompt": [1, 2, 3]}),
        http.post("/completion", json={"prompt": "x", "temperature": "warm"}),
        # a field that would change the answer and is not served is refused, never ignored
        http.post("/completion", json={"prompt": "x", "logit_bias": [[10**9, -100]]}),  # outside the vocabulary
        http.post("/completion", json={"prompt": "x", "mirostat": 2}),
        http.post("/tokenize", content=b"x" * (9 << 20)),
    ):
        error = r.json()["error"]
        assert 400 <= r.status_code < 500 and error["code"] == r.status_code and error["message"], r.text


@pytest.fixture(scope="module")
def llama_server(llama_tools, smollm2_path, tmp_path_factory):
    """llama-server itself, built from the same vendored sources, on the same file."""
    from bench.bench_serve import _free_port, _server
    from quantize.llm import use_extra_buffers

    port = _free_port()
    cmd = [str(llama_tools / "llama-server"), "-m", str(smollm2_path), "-c", "512", "-np", "1", "-t", str(default_threads()),
           "--no-webui", "--host", "127.0.0.1", "--port", str(port),
           *([] if use_extra_buffers() else ["--no-repack"])]  # the engine's weight layout on this CPU
    with _server(cmd, port, "llama-server", tmp_path_factory.mktemp("llama-server")) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def test_tokenize_template_and_greedy_completion_agree_with_llama_server(http, llama_server):
    for body in ({"content": "Hello, world! Ünïcode too."}, {"content": "<|im_start|>user\nhi<|im_end|>"},
                 {"content": "Hello", "add_special": True}, {"content": "Hello, world!", "with_pieces": True}):
        assert http.post("/tokenize", json=body).json() == llama_server.post("/tokenize", json=body).json(), body
    tokens = llama_server.post("/tokenize", json={"content": "Ünïcode, too."}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json() == llama_server.post("/detokenize", json={"tokens": tokens}).json()
    messages = [{"role": "system", "content": "Be brief."}, *HI, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Again."}]
    ours = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    assert ours == llama_server.post("/apply-template", json={"messages": messages}).json()["prompt"]
    body = {"prompt": "The capital of France is", "n_predict": 12, "temperature": 0}
    ours, theirs = http.post("/completion", json=body).json(), llama_server.post("/completion", json=body).json()
    assert ours["content"] == theirs["content"] and ours["tokens_predicted"] == theirs["tokens_predicted"]
    assert ours["tokens_evaluated"] == theirs["tokens_evaluated"]


def test_completion_probabilities_in_llama_servers_shape(http, engine):
    body = {"prompt": "The capital of France is", "n_predict": 5, "temperature": 0, "n_probs": 3}
    whole = http.post("/completion", json=body).json()
    probs = whole["completion_probabilities"]
    assert len(probs) == whole["tokens_predicted"] == 5
    assert "".join(p["token"] for p in probs) == whole["content"]
    for p in probs:
        assert engine.detokenize([p["id"]]) == p["token"] and bytes(p["bytes"]).decode() == p["token"]
        assert p["logprob"] <= 0 and len(p["top_logprobs"]) == 3
        # greedy: the token chosen is the most likely one
        assert p["top_logprobs"][0]["id"] == p["id"] and p["top_logprobs"][0]["logprob"] == pytest.approx(p["logprob"])
        assert all(engine.detokenize([t["id"]]) == t["token"] for t in p["top_logprobs"])
    with http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    streamed = [p for e in events[:-1] for p in e["completion_probabilities"]]
    assert streamed == probs and [t for e in events[:-1] for t in e["tokens"]] == [p["id"] for p in probs]
    # without n_probs there are none, and post-sampling probabilities are refused by name
    assert "completion_probabilities" not in http.post("/completion", json={**body, "n_probs": 0}).json()
    r = http.post("/completion", json={**body, "post_sampling_probs": True})
    assert r.status_code == 400 and "post_sampling_probs" in r.json()["error"]["message"]


def test_completion_reports_its_own_settings_and_tokens(http, engine):
    body = {"prompt": "List three colours, one per line:\n", "n_predict": 12, "temperature": 0, "top_k": 7, "seed": 5,
            "stop": ["zz"], "return_tokens": True}
    whole = http.post("/completion", json=body).json()
    settings = whole["generation_settings"]
    assert (settings["temperature"], settings["top_k"], settings["seed"], settings["n_predict"], settings["stop"]) == (0, 7, 5, 12, ["zz"])
    assert whole["tokens"] and engine.detokenize(whole["tokens"]) == whole["content"]
    assert whole["has_new_line"] == ("\n" in whole["content"]) and whole["index"] == 0
    assert http.post("/completion", json={**body, "return_tokens": False}).json()["tokens"] == []
    assert http.get("/props").json()["default_generation_settings"]["params"]["n_predict"] == -1


def test_completion_probabilities_agree_with_llama_server(http, llama_server):
    body = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0, "n_probs": 4}
    ours, theirs = http.post("/completion", json=body).json(), llama_server.post("/completion", json=body).json()
    pick = [[(p["id"], p["token"], p["bytes"]) for p in [t, *t["top_logprobs"]]] for t in ours["completion_probabilities"]]
    assert pick == [[(p["id"], p["token"], p["bytes"]) for p in [t, *t["top_logprobs"]]] for t in theirs["completion_probabilities"]]
    for a, b in zip(ours["completion_probabilities"], theirs["completion_probabilities"], strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=0.05)
    assert set(ours) >= set(theirs) - {"timings"} | {"has_new_line", "index", "tokens"}


def test_chat_answers_carry_llama_servers_timings(http, llama_server):
    body = {"messages": HI, "max_tokens": 5, "temperature": 0}
    whole = http.post("/v1/chat/completions", json=body).json()
    timings, usage = whole["timings"], whole["usage"]
    assert timings["predicted_n"] == usage["completion_tokens"] and timings["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"] and timings["predicted_per_second"] > 0
    assert set(timings) == set(llama_server.post("/v1/chat/completions", json=body).json()["timings"])
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=stream) as r:
        chunks = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["timings"]["predicted_n"] == chunks[-1]["usage"]["completion_tokens"]
    legacy = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).json()
    assert legacy["timings"]["predicted_n"] == legacy["usage"]["completion_tokens"]


def test_apply_template_without_the_generation_prompt(http, llama_server):
    body = {"messages": HI, "add_generation_prompt": False}
    ours = http.post("/apply-template", json=body).json()["prompt"]
    assert ours == llama_server.post("/apply-template", json=body).json()["prompt"]
    assert ours.endswith("Say hello.<|im_end|>\n")
    assert http.post("/apply-template", json={**body, "add_generation_prompt": True}).json()["prompt"].endswith("<|im_start|>assistant\n")
    r = http.post("/apply-template", json={**body, "add_generation_prompt": "no"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


# a thinking template that closes the block unless told to think (as llama.cpp's DeepSeek-R1 ones do)
CLOSED_UNLESS_ASKED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% if not enable_thinking %}</think>\n{% endif %}{% endif %}"
)


def test_a_thinking_template_closed_unless_asked_still_thinks(models_root):
    settings = ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None)
    with Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=1, paths=models_root, chat_template=CLOSED_UNLESS_ASKED)) as eng:
        opened = eng.prompts.text(ChatRequest(messages=HI))
        assert opened.endswith("<|im_start|>assistant\n<think>\n")
        assert eng.prompt_text_tokens(opened) == eng.prompt_tokens(ChatRequest(messages=HI))
        assert eng.prompts.text(ChatRequest(messages=HI, reasoning_budget=0)).endswith("<think>\n</think>\n")
        with serving(create_app(settings, eng)) as url, httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
            assert client.post("/apply-template", json={"messages": HI}).json()["prompt"] == opened
            off = client.post("/apply-template", json={"messages": HI, "reasoning_effort": "none"}).json()["prompt"]
            assert off.endswith("</think>\n")
            kwargs = client.post("/apply-template", json={"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}).json()
            assert kwargs["prompt"] == off


def test_templates_get_todays_date(models_root):
    """Llama 3.x templates fall back to a fixed day unless given date_string, as llama.cpp does."""
    import datetime

    template = ("{% if not date_string is defined %}{% set date_string = '26 Jul 2024' %}{% endif %}Today Date: {{ date_string }}\n"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=1, paths=models_root, chat_template=template)) as eng:
        prompt = eng.prompts.text(ChatRequest(messages=HI))
        assert prompt.startswith(f"Today Date: {datetime.date.today().strftime('%d %b %Y')}\n")
        assert eng.prompt_text_tokens(prompt) == eng.prompt_tokens(ChatRequest(messages=HI))
