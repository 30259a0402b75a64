"""Fill in the middle (engine/prompt/fim.py) on the real Qwen2.5-Coder-0.5B: llama-server's /infill,
OpenAI's /v1/completions and Ollama's /api/generate with a suffix, against llama-server itself."""

from __future__ import annotations

import json

import httpx
import pytest
from serving import serving
from test_server import wait_idle

from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.engine.types.request import Infill
from edgechat.models.planner import default_threads
from edgechat.server import ServerSettings, create_app

pytestmark = pytest.mark.slow

N_CTX = 4096
#: a long fill prefills ~2,000 tokens: minutes on a loaded 2-core machine
TIMEOUT_S = 900

# the line the cursor is on is missing: the model writes it from what comes after (`message`)
PREFIX = "def greet(name):\n    "
SUFFIX = '\n    return message\n\n\nprint(greet("Ada"))\n'
MISSING = 'message = "Hello, " + name + "!"'
FILL = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 16, "temperature": 0}


@pytest.fixture(scope="module")
def engine(qwen_coder_path, models_root):
    eng = Engine(EngineConfig(model=str(qwen_coder_path), n_ctx=N_CTX, n_parallel=1, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def http(engine):
    settings = ServerSettings(model_id="qwen-coder", degrade_queue_wait=None)
    with serving(create_app(settings, engine)) as url:
        with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
            yield client


@pytest.fixture(scope="module")
def llama_server(llama_tools, qwen_coder_path, tmp_path_factory):
    """llama-server itself, built from the same vendored sources, on the same file and context."""
    from bench.bench_serve import _free_port, _server
    from quantize.llm import use_extra_buffers

    port = _free_port()
    cmd = [str(llama_tools / "llama-server"), "-m", str(qwen_coder_path), "-c", str(N_CTX), "-np", "1", "-t", str(default_threads()),
           "--no-webui", "--host", "127.0.0.1", "--port", str(port), *([] if use_extra_buffers() else ["--no-repack"])]
    with _server(cmd, port, "llama-server", tmp_path_factory.mktemp("llama-server")) as url:
        with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
            yield client


def _events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]


def test_infill_writes_the_missing_line_streamed_as_whole(http):
    whole = http.post("/infill", json=FILL).json()
    assert whole["content"].split("\n")[0] == MISSING, whole["content"]
    assert whole["stop"] and whole["tokens_evaluated"] > 20 and whole["prompt"].endswith("<|fim_middle|>")
    events = _events(http, "/infill", FILL)
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["stop"] and events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_prompt_and_answer_equal_llama_servers(http, llama_server):
    body = {**FILL, "input_extra": [{"filename": "shapes/circle.py", "text": "import math\n\n\ndef circle_area(r):\n    return math.pi * r * r\n"},
                                    {"text": "PI = 3.14159\n"}],
            "prompt": "    return"}
    ours, theirs = http.post("/infill", json=body).json(), llama_server.post("/infill", json=body).json()
    assert ours["prompt"] == theirs["prompt"]
    assert ours["tokens_evaluated"] == theirs["tokens_evaluated"]
    assert ours["content"] == theirs["content"]


def test_extra_files_come_before_the_prefix(engine):
    fim = engine.backend.fim_tokens()
    infill = Infill(PREFIX, SUFFIX, (("util.py", "def helper():\n    pass\n"),))
    tokens = engine.prompt_tokens(ChatRequest(infill=infill))
    text = engine.detokenize(tokens, special=True)
    assert text == ("<|repo_name|>myproject\n<|file_sep|>util.py\ndef helper():\n    pass\n<|file_sep|>filename\n"
                    f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    assert tokens.index(fim.sep) < tokens.index(fim.pre) < tokens.index(fim.suf) < tokens.index(fim.mid) == len(tokens) - 1


def test_other_files_take_what_the_context_holds_beyond_the_batch(engine):
    # llama-server's budget for them (format_prompt_infill): the slot's context less its batch
    # less twice its own n_predict (-1 unless started with -n), whatever the request's n_predict
    chunk = "".join(f"LIMIT_{i} = {i * 7}\n" for i in range(500))
    fim = engine.backend.fim_tokens()
    tokens = engine.prompt_tokens(ChatRequest(infill=Infill(PREFIX, SUFFIX, (("limits.py", chunk),)), max_tokens=32))
    extra = [fim.rep, *engine.tokenize("myproject\n"), fim.sep, *engine.tokenize("limits.py\n"), *engine.tokenize(chunk),
             fim.sep, *engine.tokenize("filename\n")]
    n_extra = N_CTX - 2048 + 2
    assert len(extra) > n_extra
    assert tokens[: tokens.index(fim.pre)] == extra[-n_extra:]


def _long_file() -> tuple[str, str]:
    lines = [f"def f{i}(x):\n    return x + {i}\n\n" for i in range(400)]
    return "".join(lines[:300]), "".join(lines[300:])


def test_a_long_file_loses_its_far_ends_not_the_cursor(engine, llama_server):
    prefix, suffix = _long_file()
    fim = engine.backend.fim_tokens()
    tokens = engine.prompt_tokens(ChatRequest(infill=Infill(prefix, suffix), max_tokens=8))
    pre, suf = tokens.index(fim.pre), tokens.index(fim.suf)
    kept_prefix, kept_suffix = tokens[pre + 1 : suf], tokens[suf + 1 : -1]
    all_prefix, all_suffix = engine.tokenize(prefix), engine.tokenize(suffix)
    # llama.cpp's budgets in a batch of 2048: 3/4 for the prefix, the quarter less two for the suffix
    assert len(all_prefix) > 1536 and kept_prefix == all_prefix[-1536:]
    assert len(all_suffix) > 510 and kept_suffix == all_suffix[:510]
    theirs = llama_server.post("/infill", json={"input_prefix": prefix, "input_suffix": suffix, "n_predict": 1}).json()
    assert theirs["tokens_evaluated"] == len(tokens)
    assert theirs["prompt"] == engine.detokenize(tokens, special=True)


def test_the_next_keystrokes_reuse_the_cache(http, engine):
    prefix, suffix = _long_file()
    suffix = suffix[:400]
    fim = engine.backend.fim_tokens()

    def fill(prefix: str) -> tuple[dict, list[int]]:
        body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 4}
        return http.post("/infill", json=body).json(), engine.prompt_tokens(ChatRequest(infill=Infill(prefix, suffix), max_tokens=4))

    first, _ = fill(prefix)
    # one more character typed at the cursor: the file before it is in the cache (its last token
    # may merge with the new character, and the prefix's budget may push its first token out)
    typed, _ = fill(prefix + "d")
    assert typed["tokens_cached"] >= 1536 - 2, (first, typed)
    # the cursor a function further down: the file's start left the prompt, the rest of the
    # prefix is still in the cache, moved down as llama-server --cache-reuse moves it
    moved_prefix = prefix + "def g(x):\n    return x * 2\n\n"
    moved, tokens = fill(moved_prefix)
    added = len(engine.tokenize(moved_prefix)) - len(engine.tokenize(prefix))
    assert tokens.index(fim.suf) - tokens.index(fim.pre) - 1 == 1536
    assert moved["tokens_cached"] >= 1536 - added - 2, (typed, moved)
    assert engine.kv_problems() == []


def test_a_disconnect_cancels_the_fill(http, engine):
    body = {**FILL, "n_predict": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/infill", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
        assert engine.stats()["running"] == 1
    stats = wait_idle(engine)
    assert stats["running"] == 0 and engine.kv_problems() == []


def test_a_time_limit_ends_the_fill_at_a_newline(http):
    body = {**FILL, "input_prefix": "def primes(n):\n", "input_suffix": "", "n_predict": 64, "ignore_eos": True, "t_max_predict_ms": 1}
    answer = http.post("/infill", json=body).json()
    assert answer["stop_type"] == "limit" and answer["tokens_predicted"] < 64
    assert answer["content"].endswith("\n") and answer["content"].count("\n") == 1, answer["content"]


def test_openai_and_ollama_suffix_fill_as_infill(http):
    infill = http.post("/infill", json=FILL).json()["content"]
    legacy = http.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 16, "temperature": 0}).json()
    assert legacy["choices"][0]["text"] == infill
    ollama = http.post("/api/generate", json={"prompt": PREFIX, "suffix": SUFFIX, "stream": False,
                                              "options": {"num_predict": 16, "temperature": 0}}).json()
    assert ollama["response"] == infill


def test_response_fields_pick_and_unnest(http):
    answer = http.post("/infill", json={**FILL, "response_fields": ["content", "timings/predicted_n", "nothing/here"]}).json()
    assert set(answer) == {"content", "timings/predicted_n"} and answer["timings/predicted_n"] > 0


def test_bad_fills_refused_in_llama_servers_shape(http):
    for body in ({"input_suffix": ""}, {"input_prefix": "", "input_suffix": "", "input_extra": {"text": "x"}},
                 {"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a.py"}]},
                 {"input_prefix": 3, "input_suffix": ""}):
        r = http.post("/infill", json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == 400 and "\n" not in error["message"], r.text


def test_a_model_without_fim_tokens_is_refused_in_one_line(smollm2_path, models_root):
    with Engine(EngineConfig(model=str(smollm2_path), n_ctx=512, paths=models_root)) as eng:
        with serving(create_app(ServerSettings(model_id="smol", degrade_queue_wait=None), eng)) as url:
            for path, body, message in (
                ("/infill", {"input_prefix": "a", "input_suffix": "b"}, lambda r: r["error"]["message"]),
                ("/v1/completions", {"prompt": "a", "suffix": "b"}, lambda r: r["error"]["message"]),
                ("/api/generate", {"prompt": "a", "suffix": "b", "stream": False}, lambda r: r["error"]),
            ):
                r = httpx.post(url + path, json=body, timeout=30)
                text = message(r.json())
                assert r.status_code == 400 and "cannot fill in the middle" in text and "\n" not in text, (path, r.text)


def test_run_suffix_fills_in_one_shot(qwen_coder_path, http):
    from test_cli import assert_one_line_error, edgechat

    proc = edgechat("run", "--json", "--temperature", "0", "--max-tokens", "16", "-m", str(qwen_coder_path), "--ctx", str(N_CTX),
                    "--suffix", SUFFIX, PREFIX)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"] == http.post("/infill", json=FILL).json()["content"]
    assert_one_line_error(edgechat("run", "--suffix", "x", "--system", "Be brief.", "y"), "--suffix", "--system")
