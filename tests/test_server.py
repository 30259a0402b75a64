"""The OpenAI-compatible server end to end: real engine, real SmolLM2, uvicorn on loopback, official client."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from serving import serving

from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.server import ServerSettings, create_app

KEY = "sk-test-key"
MODEL = "smollm2-135m-instruct"
N_CTX = 512
HI = [{"role": "user", "content": "Say hello."}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(models_root):
    eng = Engine(EngineConfig(model=MODEL, n_ctx=N_CTX, n_parallel=4, max_queue=4, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_url(engine):
    settings = ServerSettings(api_key=KEY, max_input_tokens=300, model_id=MODEL, degrade_queue_wait=None)
    with serving(create_app(settings, engine)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def wait_idle(engine, timeout=5.0) -> dict:
    """The engine's stats once nothing runs or waits (cancellation lands within a step)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def metric(base_url: str, name: str) -> float:
    return _value(httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text, name)


def test_models_lists_the_loaded_model(client):
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_non_streaming_and_streaming_give_the_same_greedy_answer(client):
    args = dict(model=MODEL, messages=HI, max_tokens=12, temperature=0, seed=1)
    full = client.chat.completions.create(**args)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the second identical request found its prompt in a free sequence's cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_legacy_completions_endpoint(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens <= 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == out.choices[0].text


def test_logit_bias_bans_and_forces_tokens_through_the_official_client(client, engine, base_url):
    args = dict(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**args).choices[0].message.content
    first = engine.tokenize(plain)[0]
    banned = client.chat.completions.create(**args, logit_bias={str(first): -100}).choices[0].message.content
    assert banned and first not in engine.tokenize(banned), (plain, banned)
    # +100 all but forces a token: greedy writes nothing else
    forced = engine.tokenize(" stone")[0]
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                     logit_bias={str(forced): 100}).choices[0].text
    assert engine.tokenize(text) == [forced] * 4, text
    # llama-server's pairs on /completion, false banning the token, reported in its settings
    body = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0, "return_tokens": True}
    plain = httpx.post(f"{base_url}/completion", json=body, headers={"Authorization": f"Bearer {KEY}"}).json()
    first = plain["tokens"][0]
    out = httpx.post(f"{base_url}/completion", json={**body, "logit_bias": [[first, False]]},
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    assert first not in out["tokens"] and out["generation_settings"]["logit_bias"] == [{"token": first, "bias": False}]
    # an id outside the vocabulary is a 400 naming the field, before anything runs
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args, logit_bias={str(10**9): -100})
    assert info.value.param == "logit_bias" and "vocabulary" in info.value.message


def test_input_tokens_count_the_prompt_the_answer_decodes(client, base_url):
    auth = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "system", "content": "Be brief."}, *HI]
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        r = httpx.post(f"{base_url}{path}", json={"model": MODEL, "messages": messages}, headers=auth)
        assert r.status_code == 200 and r.json() == {"input_tokens": used}, r.text
    used = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=16,
                                   store=False).usage.input_tokens
    r = httpx.post(f"{base_url}/v1/responses/input_tokens", json={"model": MODEL, "input": "Say hello.", "instructions": "Be brief."},
                   headers=auth)
    assert r.json() == {"object": "response.input_tokens", "input_tokens": used}, r.text
    # and through the official client's own call for it
    assert client.responses.input_tokens.count(model=MODEL, input="Say hello.", instructions="Be brief.").input_tokens == used
    # a bad body is the same 400 the answer's route gives
    r = httpx.post(f"{base_url}/v1/chat/completions/input_tokens", json={"model": MODEL, "messages": "hi"}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_typed_errors_reach_the_official_client(client, base_url):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{base_url}/metrics").status_code == 401
    assert httpx.get(f"{base_url}/health").status_code == 200  # the one open endpoint

    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2)
    assert info.value.code == "model_not_found"

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature="warm")
    assert info.value.param == "temperature"

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert info.value.param == "messages"

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "   "}], max_tokens=2)
    assert "empty" in info.value.message

    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{base_url}/v1/chat/completions", content=b"x" * (ServerSettings.max_body_bytes + 1), headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"{base_url}/v1/chat/completions", headers=auth)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_over_long_prompts_get_400_with_both_counts(client, engine):
    # over --max-input-tokens (300), checked before any compute
    long = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    n = engine.count_tokens(ChatRequest(messages=long))
    assert f"{n} tokens" in info.value.message and "300" in info.value.message


def test_a_flood_of_messages_is_refused_at_once_while_a_normal_request_is_answered(client, base_url):
    args = dict(model=MODEL, messages=HI, max_tokens=12, temperature=0)
    alone = client.chat.completions.create(**args).choices[0].message.content
    flood = {"model": MODEL, "messages": [{"role": "user", "content": "word"}] * 20_000, "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        normal = pool.submit(client.chat.completions.create, **args)
        started = time.monotonic()
        r = httpx.post(f"{base_url}/v1/chat/completions", json=flood, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        elapsed = time.monotonic() - started
        answer = normal.result(timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages", r.text
    assert elapsed < 5, f"the flood took {elapsed:.1f} s to refuse"  # a hang guard; schemas test the order of checks
    assert answer.choices[0].message.content == alone


@pytest.fixture(scope="module")
def open_url(engine):
    """A second app on the same engine: no key, no --max-input-tokens (only the context limits)."""
    with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), engine)) as url:
        yield url


def test_a_prompt_that_leaves_no_room_for_the_answer_is_refused_by_the_engine(open_url, engine):
    messages = [{"role": "user", "content": "word " * 450}]
    c = openai.OpenAI(base_url=f"{open_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=messages)
    assert info.value.code == "context_length_exceeded"
    # the engine keeps a quarter of the context for the answer
    n = engine.count_tokens(ChatRequest(messages=messages))
    assert f"resulted in {n} tokens" in info.value.message
    assert f"maximum context length is {N_CTX - N_CTX // 4} tokens" in info.value.message


def test_huge_max_tokens_is_clamped_to_the_room_left_in_the_context(open_url, engine):
    # a prompt a dozen or so tokens short of the context keeps the clamped answer short
    words = N_CTX - 40
    while engine.count_tokens(ChatRequest(messages=[{"role": "user", "content": "word " * words}])) < N_CTX - 16:
        words += 4
    c = openai.OpenAI(base_url=f"{open_url}/v1", api_key="none", max_retries=0, timeout=120)
    out = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "word " * words}],
        max_tokens=10**9,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == N_CTX
    wait_idle(engine)
    assert engine.kv_problems() == []


def test_full_queue_answers_429_with_retry_after(client, engine, base_url):
    rejected_before = metric(base_url, 'edgechat_requests_total{outcome="rejected"}')

    def one(_):
        try:
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, extra_body={"ignore_eos": True})
            return 200, None
        except openai.RateLimitError as exc:
            return 429, exc.response.headers.get("retry-after")

    # at most 4 wait for the 4 sequences; the rest arrive while those are still generating
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    statuses = [s for s, _ in results]
    assert statuses.count(200) >= 4 and statuses.count(429) >= 1
    assert statuses.count(200) + statuses.count(429) == 12
    assert all(int(ra) >= 1 for s, ra in results if s == 429)
    assert metric(base_url, 'edgechat_requests_total{outcome="rejected"}') - rejected_before == statuses.count(429)
    wait_idle(engine)
    assert engine.kv_problems() == []


def test_disconnect_mid_stream_cancels_and_frees_the_sequence(client, engine, base_url):
    cancelled = metric(base_url, 'edgechat_requests_total{outcome="cancelled"}')
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 3:
            break
    assert engine.stats()["running"] == 1
    stream.close()
    stats = wait_idle(engine, timeout=3)
    assert stats["running"] == 0 and engine.kv_problems() == []
    deadline = time.monotonic() + 3
    while metric(base_url, 'edgechat_requests_total{outcome="cancelled"}') == cancelled:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_request_timeout_cancels(engine):
    app = create_app(ServerSettings(model_id=MODEL, request_timeout=0.5, degrade_queue_wait=None), engine)
    with serving(app) as url:
        body = {"model": MODEL, "messages": HI, "max_tokens": 400, "ignore_eos": True}
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert time.monotonic() - started < 5
        events = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert '"code": "timeout"' in events[-1]
        wait_idle(engine)
        assert engine.kv_problems() == []
        metrics = httpx.get(f"{url}/metrics").text
        assert 'edgechat_requests_total{outcome="timeout"} 2.0' in metrics


TTFT_COUNT = f'edgechat_time_to_first_token_seconds_count{{model="{MODEL}",priority="default"}}'


def test_metrics_count_what_was_served(client, base_url, engine):
    before = {n: metric(base_url, n) for n in ("edgechat_completion_tokens_total", "edgechat_prompt_tokens_total", TTFT_COUNT)}
    ok_before = metric(base_url, 'edgechat_requests_total{outcome="ok"}')
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6)
    assert metric(base_url, "edgechat_completion_tokens_total") - before["edgechat_completion_tokens_total"] == out.usage.completion_tokens
    assert metric(base_url, "edgechat_prompt_tokens_total") - before["edgechat_prompt_tokens_total"] == out.usage.prompt_tokens
    assert metric(base_url, TTFT_COUNT) == before[TTFT_COUNT] + 1
    assert metric(base_url, 'edgechat_requests_total{outcome="ok"}') == ok_before + 1
    assert metric(base_url, "edgechat_kv_cells_total") == engine.stats()["kv_total"]
    assert metric(base_url, "edgechat_running_sequences") == 0
    # the finished request's prompt and answer stay in its idle sequence for prefix reuse
    assert metric(base_url, "edgechat_kv_cells_cached") >= out.usage.prompt_tokens
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("edgechat_queue_wait_seconds_bucket", "edgechat_time_per_output_token_seconds_bucket", "edgechat_request_duration_seconds_sum", "edgechat_degraded 0.0"):
        assert name in text


def test_degrade_switch_caps_max_tokens_and_routes_to_the_fallback_under_sustained_queueing(models_root):
    # its own engines: 2 sequences and an unbounded queue, so 6 clients make requests wait;
    # the "smaller" fallback is a second SmolLM2 engine, told apart by the model id it reports;
    # no speculation: its guesses would shorten answers and so the queue waits this test needs
    def load():
        return Engine(EngineConfig(model=MODEL, n_ctx=256, n_parallel=2, paths=models_root, speculative="off"))

    engine, fallback = load(), load()
    fallback_id = fallback.model_info.path.stem
    settings = ServerSettings(model_id=MODEL, degrade_queue_wait=0.3, degrade_max_tokens=3)
    body = {"model": MODEL, "messages": HI, "max_tokens": 12, "ignore_eos": True}
    try:
        with serving(create_app(settings, engine, fallback)) as url, httpx.Client(timeout=120) as http:
            assert [m["id"] for m in http.get(f"{url}/v1/models").json()["data"]] == [MODEL, fallback_id]

            def one(_):
                r = http.post(f"{url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["usage"]["completion_tokens"], r.json()["model"]

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(one, range(14)))
            # whole answers from the main model first; capped ones from the fallback once the
            # queue wait passed 0.3 s
            assert answers[:2] == [(12, MODEL)] * 2, answers
            assert (3, fallback_id) in answers and set(answers) == {(12, MODEL), (3, fallback_id)}, answers
            metrics = http.get(f"{url}/metrics").text
            assert _value(metrics, "edgechat_degrade_switches_total") >= 1
            assert _value(metrics, "edgechat_fallback_requests_total") == answers.count((3, fallback_id))
            # a lone request finds the queue empty: the switch turns off and answers are whole again
            assert one(0) == (12, MODEL)
            assert _value(http.get(f"{url}/metrics").text, "edgechat_degraded") == 0
    finally:
        engine.close()
        fallback.close()


def _value(metrics_text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics_text.splitlines() if line.startswith(name + " "))


def test_speculative_per_request_and_its_counters(engine, base_url):
    headers = {"Authorization": f"Bearer {KEY}"}
    drafted = metric(base_url, "edgechat_draft_tokens_total")
    prompt = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog near the river."}]
    bodies = [{"model": MODEL, "messages": prompt, "max_tokens": 30, "temperature": 0, "speculative": mode} for mode in ("off", "lookup")]
    texts = []
    for body in bodies:
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]
    assert metric(base_url, "edgechat_draft_tokens_total") > drafted
    assert metric(base_url, "edgechat_draft_accepted_tokens_total") > 0
    bad = httpx.post(f"{base_url}/v1/chat/completions", json={**bodies[0], "speculative": "fast"}, headers=headers, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"
