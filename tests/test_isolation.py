"""Agent traffic kept apart from interactive chat: priority classes with their own share of the
sequences and their own queue; a request that gets no first token in time moves to the
fallback model. Checked on state (queues, who holds what, which model answered), never on
wall-clock timing, so a loaded machine cannot make them flaky."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serving import serving

from edgechat.engine import Engine, EngineConfig
from edgechat.errors import UsageError
from edgechat.server import ServerSettings, create_app
from edgechat.server.priority import ClassFull, PriorityClass, PriorityGate, parse_class

MODEL = "smollm2-135m-instruct"
AGENT_KEY, CHAT_KEY = "sk-agent", "sk-chat"
HI = [{"role": "user", "content": "Say hi."}]
#: an answer that outlasts the test: it holds its sequence until its client hangs up
ENDLESS = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 900, "ignore_eos": True, "stream": True}


# ---------------------------------------------------------------- the gate alone


def test_gate_shares_queues_and_retry_after():
    async def run():
        gate = PriorityGate((PriorityClass("chat", 1, queue=2), PriorityClass("agent", 2, queue=1)), n_parallel=3)
        a1, a2 = gate.reserve("agent", 1), gate.reserve("agent", 1)
        a3 = gate.reserve("agent", 1)  # the share is held: it queues
        assert a1.admitted.done() and a2.admitted.done() and not a3.admitted.done()
        with pytest.raises(ClassFull) as full:
            gate.reserve("agent", 1)  # and the queue of one is full
        assert 1 <= full.value.retry_after <= 60
        # the other class is admitted at once, whatever waits in the agents' queue; and the reverse
        c1 = gate.reserve("chat", 1)
        c2 = gate.reserve("chat", 1)
        assert c1.admitted.done() and not c2.admitted.done()
        assert gate.snapshot() == {"chat": {"running": 1, "waiting": 1, "share": 1}, "agent": {"running": 2, "waiting": 1, "share": 2}}
        gate.release(a1)  # a finished agent call hands its place to the next agent, not to chat
        assert a3.admitted.done() and not c2.admitted.done()
        gate.release_all(c2)  # a waiting request that gives up leaves the queue
        assert gate.snapshot()["chat"] == {"running": 1, "waiting": 0, "share": 1}
        # a two-choice request waits for two units; the head of the queue is not overtaken
        big = gate.reserve("agent", 2)
        gate.release(a2)
        assert not big.admitted.done()
        gate.release(a3)
        assert big.admitted.done()

    asyncio.run(run())


def test_retry_after_follows_the_class_measured_hold_time():
    async def run():
        gate = PriorityGate((PriorityClass("agent", 1, queue=10),), n_parallel=1)
        state = gate.states["agent"]
        state.hold_s = 4.0  # as if each agent call held its sequence for 4 s
        first = gate.reserve("agent", 1)
        for _ in range(3):
            gate.reserve("agent", 1)
        # three ahead, one sequence, 4 s each: the fourth waiting place frees in about 16 s
        assert gate.retry_after("agent") == 16
        gate.release(first)
        assert gate.retry_after("agent") < 16

    asyncio.run(run())


def test_bad_class_settings_are_one_line_errors():
    assert parse_class("agent=3:10") == PriorityClass("agent", 3, 10)
    for text in ("agent", "agent=0", "=2", "agent=x"):
        with pytest.raises(UsageError, match="NAME=SHARE"):
            parse_class(text)
    with pytest.raises(UsageError, match="more than the 2"):
        PriorityGate((PriorityClass("a", 2), PriorityClass("b", 1)), n_parallel=2)


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def engine(models_root):
    eng = Engine(EngineConfig(model=MODEL, n_ctx=1024, n_parallel=3, max_queue=16, paths=models_root))
    yield eng
    eng.close()


def _gauges(url: str, key: str) -> dict[str, tuple[int, int]]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=60).text
    running = dict(re.findall(r'edgechat_priority_running\{priority="(\w+)"\} (\d+)', text))
    queued = dict(re.findall(r'edgechat_priority_queued\{priority="(\w+)"\} (\d+)', text))
    return {k: (int(running[k]), int(queued[k])) for k in running}


def _hold(url: str, key: str | None, release: threading.Event) -> int:
    """One endless streamed answer, held open until `release`; returns the HTTP status."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"model": MODEL, **ENDLESS}, headers=headers, timeout=300) as r:
        if r.status_code == 200:
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            release.wait(300)
        return r.status_code


def _wait_for(predicate, what: str, limit: float = 300.0):
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_agent_burst_does_not_hold_up_a_chat(engine):
    settings = ServerSettings(
        api_key="sk-any",
        model_id=MODEL,
        degrade_queue_wait=None,
        priority_classes=(PriorityClass("interactive", 1, queue=4), PriorityClass("agent", 2, queue=4)),
        key_classes={AGENT_KEY: "agent", CHAT_KEY: "interactive"},
    )
    with serving(create_app(settings, engine)) as url, ThreadPoolExecutor(8) as pool:
        release = threading.Event()
        try:
            agents = [pool.submit(_hold, url, AGENT_KEY, release) for _ in range(6)]
            # two hold the agents' share, four wait in their queue
            _wait_for(lambda: _gauges(url, CHAT_KEY)["agent"] == (2, 4), "the agents' share and queue never filled")
            # a seventh agent call finds the queue full: 429 with an estimate of the wait
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2}, headers={"Authorization": f"Bearer {AGENT_KEY}"}, timeout=60)
            assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
            # the chat is admitted at once and answered while every agent call still runs or waits
            headers = {"Authorization": f"Bearer {CHAT_KEY}"}
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 4}, headers=headers, timeout=600)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
            assert _gauges(url, CHAT_KEY) == {"interactive": (0, 0), "agent": (2, 4)}
            assert not any(a.done() for a in agents)
            # a key's class is its own: X-Priority cannot lift an agent key
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2}, headers={"Authorization": f"Bearer {AGENT_KEY}", "X-Priority": "interactive"}, timeout=60)
            assert r.status_code == 429
            # a key without a class takes the one X-Priority names, which must exist
            other = {"Authorization": "Bearer sk-any"}
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HI}, headers={**other, "X-Priority": "vip"}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "X-Priority"
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2}, headers={**other, "X-Priority": "interactive"}, timeout=600)
            assert r.status_code == 200
        finally:
            release.set()
        assert sorted(a.result() for a in agents) == [200] * 6
        metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=60).text
        # latencies by class: the chat's TTFT is in the interactive series
        assert f'edgechat_time_to_first_token_seconds_count{{model="{MODEL}",priority="interactive"}} 2.0' in metrics
    _wait_for(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0, "the agents' answers were not freed")
    assert engine.kv_problems() == []


def test_a_stream_waiting_for_its_class_share_gets_keepalive_comments(engine):
    settings = ServerSettings(
        api_key="sk-any", model_id=MODEL, degrade_queue_wait=None, keepalive_s=0.1, priority_classes=(PriorityClass("agent", 1, queue=2),), key_classes={AGENT_KEY: "agent"}
    )
    headers = {"Authorization": f"Bearer {AGENT_KEY}"}
    body = {"model": MODEL, "messages": HI, "max_tokens": 5, "temperature": 0}
    lines: list[str] = []

    def queued_stream() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)

    with serving(create_app(settings, engine)) as url, ThreadPoolExecutor(2) as pool:
        expected = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300).json()["choices"][0]["message"]["content"]
        release = threading.Event()
        try:
            hold = pool.submit(_hold, url, AGENT_KEY, release)
            _wait_for(lambda: _gauges(url, AGENT_KEY)["agent"] == (1, 0), "the agents' share never filled")
            stream = pool.submit(queued_stream)
            # the stream is open and kept alive while it waits in its class's queue
            _wait_for(lambda: lines or stream.done(), "no keep-alive came")
            assert _gauges(url, AGENT_KEY)["agent"] == (1, 1) and lines[0] == ": keep-alive"
        finally:
            release.set()
        assert hold.result() == 200
        stream.result()
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert all(line == ": keep-alive" for line in lines[:first_data]) and lines[-1] == "data: [DONE]"
    # (comments may come between chunks too: on a loaded machine a token can take keepalive_s)
    deltas = [json.loads(line[len("data: ") :])["choices"][0] for line in lines if line.startswith("data: {")]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == expected and deltas[-1]["finish_reason"] == "length"
    _wait_for(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0, "the answers were not freed")


def test_no_first_token_in_time_fails_over_to_the_fallback(engine, models_root):
    fallback = Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=1, paths=models_root))
    try:
        # the primary's three sequences are all busy: a new request waits in its queue
        settings = ServerSettings(model_id="primary", degrade_queue_wait=None, keepalive_s=0.1)
        with serving(create_app(settings, engine, fallback)) as url, ThreadPoolExecutor(4) as pool:
            release = threading.Event()
            try:
                busy = [pool.submit(_hold, url, None, release) for _ in range(3)]
                _wait_for(lambda: engine.stats()["running"] == 3 or any(b.done() for b in busy), "the primary never filled")
                # a hold that ended already failed: show its error now, not after the wait
                assert not [b.result() for b in busy if b.done()]
                r = httpx.post(
                    f"{url}/v1/chat/completions", json={"model": "primary", "messages": HI, "max_tokens": 4}, headers={"X-Failover-After": "0.5"}, timeout=120
                )
                body = r.json()
                assert r.status_code == 200 and body["model"] == fallback.model_info.path.stem, body
                # a stream opens with keep-alive comments while it waits; the official client
                # reads past them to the fallback's answer
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
                chunks = list(client.chat.completions.create(model="primary", messages=HI, max_tokens=4, stream=True, extra_headers={"X-Failover-After": "0.5"}))
                assert {c.model for c in chunks} == {fallback.model_info.path.stem}
                assert "".join(c.choices[0].delta.content or "" for c in chunks) and chunks[-1].choices[0].finish_reason
                bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": HI}, headers={"X-Failover-After": "soon"})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Failover-After"
            finally:
                release.set()
            assert [b.result() for b in busy] == [200] * 3
            metrics = httpx.get(f"{url}/metrics").text
            assert "edgechat_failovers_total 2.0" in metrics
            assert f'edgechat_request_duration_seconds_count{{model="{fallback.model_info.path.stem}",priority="default"}} 2.0' in metrics
        _wait_for(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0, "the primary's answers were not freed")
        assert engine.kv_problems() == [] and fallback.kv_problems() == []
    finally:
        fallback.close()
