"""Faults inside the engine seen through the server: the request that hits one fails alone and
fast, the others are answered, nothing is left queued or out of step; a dead engine is a 503."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from serving import serving

from edgechat.engine import Engine, EngineConfig
from edgechat.engine.pool import ModelPool
from edgechat.server import ServerSettings, create_app

MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.slow


def ask(url: str, text: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 12, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_a_request_that_breaks_the_engine_fails_alone(models_root, monkeypatch):
    with Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=2, paths=models_root)) as engine:
        real_reuse = engine.kv.reuse

        def reuse(slot, prompt, realign):
            if "POISON" in engine.detokenize(prompt):
                raise RuntimeError("a bug met while starting this request")
            return real_reuse(slot, prompt, realign)

        monkeypatch.setattr(engine.kv, "reuse", reuse)
        settings = ServerSettings(model_id=MODEL, degrade_queue_wait=None)
        with serving(create_app(settings, engine)) as url:
            texts = ["Say hello.", "POISON: say hi.", "Name a fruit.", "POISON again.", "Name a color."]
            with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
                replies = list(pool.map(lambda t: ask(url, t), texts))
            for text, reply in zip(texts, replies, strict=True):
                if "POISON" in text:
                    assert reply.status_code == 500 and "a bug met" in reply.json()["error"]["message"]
                else:
                    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
            stats = engine.stats()
            assert stats["running"] == 0 and stats["waiting"] == 0
            assert engine.kv_problems() == []
            assert ask(url, "Say hello.").status_code == 200


class Killed(BaseException):
    """Stands for what no `except Exception` stops."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_answers_503_at_once(models_root, monkeypatch):
    with Engine(EngineConfig(model=MODEL, n_ctx=512, paths=models_root)) as engine:
        with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), engine)) as url:
            def die():
                raise Killed("the engine thread died")

            monkeypatch.setattr(engine.scheduler, "step", die)
            first = ask(url, "Say hello.")
            assert first.status_code == 500 and "the engine thread died" in first.json()["error"]["message"]
            started = time.monotonic()
            second = ask(url, "Say hello.")
            assert second.status_code == 503 and second.json()["error"]["code"] == "engine_stopped"
            assert time.monotonic() - started < 10  # refused, not queued behind a dead thread


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_served_model_whose_engine_died_is_loaded_again_for_the_next_request(models_root):
    """`serve`'s models live in the pool: a dead engine thread is a 503 with Retry-After at
    most (which agents retry), then a fresh engine answers; /health never says ok over a dead one."""
    pool = ModelPool()
    pool.add(MODEL, EngineConfig(model=MODEL, n_ctx=512, paths=models_root))
    try:
        with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), pool=pool)) as url:
            first = pool.acquire(MODEL)
            pool.release(MODEL)

            def die():
                raise Killed("the engine thread died")

            first.scheduler.step = die
            assert ask(url, "Say hello.").status_code == 500
            replies = [ask(url, "Say hello.") for _ in range(2)]
            assert all(r.status_code == 200 or (r.status_code == 503 and r.headers["Retry-After"]) for r in replies), replies
            assert replies[-1].status_code == 200 and replies[-1].json()["choices"][0]["message"]["content"]
            again = pool.acquire(MODEL)
            pool.release(MODEL)
            assert again is not first and again.stopped is None
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        pool.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_is_not_ok_over_an_engine_that_cannot_be_loaded_again(models_root):
    with Engine(EngineConfig(model=MODEL, n_ctx=512, paths=models_root)) as engine:
        with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), engine)) as url:
            def die():
                raise Killed("the engine thread died")

            engine.scheduler.step = die
            ask(url, "Say hello.")
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "error"


def test_each_request_builds_its_prompt_once(models_root, monkeypatch):
    """Templating and tokenizing a long history is most of a request's CPU before decoding:
    the server checks its limits on the same built prompt that the engine then runs."""
    with Engine(EngineConfig(model=MODEL, n_ctx=512, paths=models_root)) as engine:
        builds = []
        real_prepare = engine.prompts.prepare

        def prepare(request, policy, check_limit=True):
            builds.append(request)
            return real_prepare(request, policy, check_limit)

        monkeypatch.setattr(engine.prompts, "prepare", prepare)
        settings = ServerSettings(model_id=MODEL, max_input_tokens=300, degrade_queue_wait=None)
        with serving(create_app(settings, engine)) as url:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0}
            for extra in ({}, {"max_tokens": 10**9}, {"max_tokens": 8}):
                builds.clear()
                reply = httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60)
                assert reply.status_code == 200 and len(builds) == 1, (extra, len(builds))
