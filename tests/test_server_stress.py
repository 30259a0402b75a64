"""Reliability: a few hundred hostile and normal requests on loopback against the real engine.

Every request gets the right status, the server never falls over, and afterwards no sequence runs
and no KV cell is held; memory stays flat across rounds.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from test_server import MODEL, serving, wait_idle

from edgechat.engine import Engine, EngineConfig
from edgechat.server import ServerSettings, create_app

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hello."}]
ROUNDS, PER_ROUND, CONCURRENCY = 3, 80, 8


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


async def _sse_lines(response: httpx.Response, stop_after_content: int | None = None) -> list[str]:
    """The data lines of a stream; with stop_after_content, hang up after that many content chunks."""
    lines, content = [], 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        lines.append(line)
        if stop_after_content is not None and '"content": "' in line and '"content": ""' not in line:
            content += 1
            if content >= stop_after_content:
                break
    return lines


def _case(kind: str, rng: random.Random) -> tuple[dict, int]:
    """(how to send, expected status)."""
    if kind == "normal":
        return {"json": {"model": MODEL, "messages": HI, "max_tokens": rng.randint(1, 4)}}, 200
    if kind == "stream":
        return {"json": {"model": MODEL, "messages": HI, "max_tokens": 4, "stream": True}}, 200
    if kind == "disconnect":
        body = {"model": MODEL, "messages": HI, "max_tokens": rng.choice([64, 10**9]), "stream": True, "ignore_eos": True}
        return {"json": body, "hangup": rng.randint(1, 3)}, 200
    if kind == "abandon":
        # a non-streaming client that gives up waiting: its sequence must be cancelled too
        return {"json": {"model": MODEL, "messages": HI, "max_tokens": 256, "ignore_eos": True}, "abandon": True}, 0
    if kind == "bad_json":
        return {"content": rng.choice([b"{", b'{"messages": [}', b"null", b"", b'{"model": "x",}'])}, 400
    if kind == "wrong_type":
        field, value = rng.choice(
            [("max_tokens", "5"), ("temperature", [1]), ("messages", {"role": "user"}), ("stream", 1), ("stop", 5), ("seed", "x")]
        )
        return {"json": {"model": MODEL, "messages": HI, field: value}}, 400
    if kind == "unknown_model":
        return {"json": {"model": f"no-such-model-{rng.randint(0, 99)}", "messages": HI}}, 404
    if kind == "oversized":
        return {"json": {"model": MODEL, "messages": [{"role": "user", "content": "token " * rng.randint(350, 3000)}]}}, 400
    if kind == "empty":
        return {"json": {"model": MODEL, "messages": rng.choice([[], [{"role": "user", "content": ""}]])}}, 400
    if kind == "deep_json":
        depth = rng.randint(2_000, 200_000)
        return {"content": b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"}, 400
    if kind == "unsupported":
        field, value = rng.choice([("mirostat", 2), ("tools", [{"type": "function"}]), ("n", 5), ("top_logprobs", 3)])
        return {"json": {"model": MODEL, "messages": HI, field: value}}, 400
    if kind == "not_utf8":
        return {"content": b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}'}, 400
    raise AssertionError(kind)


KINDS = [
    "normal", "normal", "stream", "disconnect", "abandon", "bad_json", "wrong_type", "unknown_model", "oversized", "empty",
    "not_utf8", "deep_json", "unsupported",
]


async def _send(client: httpx.AsyncClient, url: str, case: dict) -> tuple[int, list[str]]:
    hangup = case.pop("hangup", None)
    abandon = case.pop("abandon", False)
    headers = {"Content-Type": "application/json"}
    if "json" in case:
        case = {"content": json.dumps(case["json"]).encode()}
    if abandon:
        try:
            await client.post(f"{url}/v1/chat/completions", headers=headers, timeout=httpx.Timeout(60, read=0.3), **case)
        except httpx.ReadTimeout:
            return 0, []
        raise AssertionError("256 tokens came back within 0.3 s")
    async with client.stream("POST", f"{url}/v1/chat/completions", headers=headers, **case) as response:
        if response.status_code != 200 or "text/event-stream" not in response.headers.get("content-type", ""):
            await response.aread()
            return response.status_code, [response.text]
        return response.status_code, await _sse_lines(response, hangup)


async def _round(url: str, rng: random.Random) -> list[tuple[str, int, int, list[str]]]:
    cases = [(kind, *_case(kind, rng)) for kind in (rng.choice(KINDS) for _ in range(PER_ROUND))]
    results = []
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(kind, case, expected):
            async with sem:
                status, lines = await _send(client, url, case)
                results.append((kind, expected, status, lines))

        await asyncio.gather(*(one(*c) for c in cases))
    return results


def test_hostile_traffic_never_breaks_the_server_or_leaks_sequences(models_root):
    engine = Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=4, max_queue=16, paths=models_root))
    try:
        settings = ServerSettings(model_id=MODEL, max_input_tokens=300, degrade_queue_wait=None)
        with serving(create_app(settings, engine)) as url:
            rng = random.Random(7)
            rss = []
            seen = []
            for _ in range(ROUNDS):
                for kind, expected, status, lines in asyncio.run(_round(url, rng)):
                    seen.append(kind)
                    assert status == expected, (kind, status, lines[:2])
                    if kind == "stream":
                        assert lines[-1] == "data: [DONE]", lines
                        assert '"finish_reason": "length"' in lines[-2] or '"finish_reason": "stop"' in lines[-2], lines
                    if expected not in (0, 200):
                        error = json.loads(lines[0])["error"]
                        assert error["message"] and error["type"], error
                stats = wait_idle(engine)
                assert stats["running"] == 0 and stats["waiting"] == 0, stats
                assert engine.kv_problems() == []
                rss.append(_rss_kib())
            assert set(seen) == set(KINDS)
            health = httpx.get(f"{url}/health").json()
            assert health["status"] == "ok" and health["running"] == 0
            # every hang-up cancelled its sequence (none of them could have finished first)
            hangups = seen.count("disconnect") + seen.count("abandon")
            metrics = httpx.get(f"{url}/metrics").text
            assert f'edgechat_requests_total{{outcome="cancelled"}} {float(hangups)}' in metrics
            # the first round warms caches and pools; later rounds must not keep growing
            print("rss KiB per round", rss)
            assert rss[-1] - rss[1] < 16 * 1024, rss
    finally:
        engine.close()
