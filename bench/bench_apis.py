"""What each API's translator costs a streamed answer (issue 26): decode tok/s through OpenAI's
Responses API (`/v1/responses`), Anthropic's Messages (`/v1/messages`) and Ollama's chat
(`/api/chat`) against `/v1/chat/completions`, on one `edgechat serve` (SmolLM2-135M, 2 threads,
one sequence, speculation off: every API gets the same process and the same greedy tokens).

Each request is streamed and parsed as a client would (every event's JSON read); its decode
tok/s is (output tokens - 1) / (last event - first text event), the output tokens from the
API's own usage. Rounds go through the prompts and, for each, the APIs in an order that
rotates, so a busy machine weighs on all alike. Reported: each API's median and its ratio to
chat completions' (target >= 0.98x).

Then the engine thread's CPU per decoded token, streamed chat completions with the same prompts
with and without a tool declared (`tool_choice` auto; SmolLM2 answers these in prose, so the
answer is watched for a call at every token): an engine of the same settings served in this
process, its thread's CPU clock (`pthread_getcpuclockid`) read at the first event carrying
answer text and at the last, over (output tokens - 1). That thread owns every step: sampling
with the grammar, the output processor, tool-call parsing and the repeat stop. It runs with one
llama.cpp thread, so its CPU holds no waiting at llama.cpp's thread barrier (a spin, which on a
busy machine grows with the load).

    python -m bench.bench_apis [--rounds 3] [--max-tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.bench_serve import _free_port, _server

MODEL = "smollm2-135m-instruct"
#: prompts SmolLM2 answers at length, so every API streams max_tokens tokens
PROMPTS = ["Describe a city you like.", "Write a note to a friend about a trip.", "Explain what a compiler does."]
REFERENCE = "chat"
#: the tool declared for the CPU measurement
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _chat(prompt: str, n: int) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _responses(prompt: str, n: int) -> tuple[str, dict]:
    return "/v1/responses", {"model": MODEL, "input": prompt, "max_output_tokens": n, "temperature": 0, "stream": True, "store": False}


def _messages(prompt: str, n: int) -> tuple[str, dict]:
    return "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0, "stream": True}


def _ollama(prompt: str, n: int) -> tuple[str, dict]:
    return "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True,
                         "options": {"temperature": 0, "num_predict": n}}


def _text_and_count(api: str, event: dict) -> tuple[bool, int | None]:
    """Whether an event carries answer text, and the output token count if it is the last."""
    if api == "chat":
        if event.get("usage"):
            return False, event["usage"]["completion_tokens"]
        return any(c["delta"].get("content") for c in event["choices"]), None
    if api == "responses":
        if event["type"] in ("response.completed", "response.incomplete"):
            return False, event["response"]["usage"]["output_tokens"]
        return event["type"] == "response.output_text.delta", None
    if api == "messages":
        if event["type"] == "message_delta":
            return False, event["usage"]["output_tokens"]
        return event["type"] == "content_block_delta", None
    if event.get("done"):
        return False, event["eval_count"]
    return bool(event["message"]["content"]), None


APIS = {"chat": _chat, "responses": _responses, "messages": _messages, "ollama": _ollama}


def decode_tps(client: httpx.Client, url: str, api: str, prompt: str, max_tokens: int) -> float:
    path, body = APIS[api](prompt, max_tokens)
    first = count = None
    with client.stream("POST", url + path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            # SSE data lines, or Ollama's NDJSON lines
            data = line[len("data: "):] if line.startswith("data: ") else line if api == "ollama" else None
            if not data or data == "[DONE]":
                continue
            text, n = _text_and_count(api, json.loads(data))
            if text and first is None:
                first = time.perf_counter()
            if n is not None:
                count, last = n, time.perf_counter()
    assert first is not None and count and count > 1, f"{api}: no answer to {prompt!r}"
    return (count - 1) / (last - first)


def engine_cpu_ms(client: httpx.Client, url: str, clock: int, prompt: str, max_tokens: int, tools: bool) -> float:
    """The engine thread's CPU ms per decoded token over one streamed chat completion."""
    _, body = _chat(prompt, max_tokens)
    first = count = None
    with client.stream("POST", url + "/v1/chat/completions", json={**body, **({"tools": TOOLS} if tools else {})}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text, n = _text_and_count("chat", json.loads(line[len("data: "):]))
            if text and first is None:
                first = time.clock_gettime(clock)
            if n is not None:
                count, last = n, time.clock_gettime(clock)
    assert first is not None and count and count > 1, f"no answer to {prompt!r}"
    return (last - first) * 1e3 / (count - 1)


def engine_cpu(rounds: int, max_tokens: int) -> dict[str, float]:
    """Median engine-thread CPU ms per token without and with the tool declared, alternating."""
    from edgechat.engine import Engine, EngineConfig
    from edgechat.server import ServerSettings, create_app

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serving import serving  # the tests' in-process uvicorn

    engine = Engine(EngineConfig(model=MODEL, n_threads=1, n_parallel=1, n_ctx=1024, speculative="off"))
    try:
        thread = next(t for t in threading.enumerate() if t.name == "edgechat-engine")
        assert thread.ident is not None
        clock = time.pthread_getcpuclockid(thread.ident)
        ms: dict[str, list[float]] = {"plain": [], "tools": []}
        with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), engine)) as url, httpx.Client(timeout=600) as client:
            engine_cpu_ms(client, url, clock, "hi", 8, False)  # warm-up
            for rnd in range(rounds):
                for k, prompt in enumerate(PROMPTS):
                    for kind in (("plain", "tools") if (rnd + k) % 2 == 0 else ("tools", "plain")):
                        ms[kind].append(engine_cpu_ms(client, url, clock, prompt, max_tokens, kind == "tools"))
    finally:
        engine.close()
    return {kind: statistics.median(v) for kind, v in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tps: dict[str, list[float]] = {api: [] for api in APIS}
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        cmd = [sys.executable, "-m", "edgechat", "serve", "-m", MODEL, "--threads", "2", "--parallel", "1", "--ctx", "1024",
               "--port", str(port), "--degrade-queue-wait", "0", "--speculative", "off", "--data-dir", tmp]
        with _server(cmd, port, "apis", Path(tmp)) as url, httpx.Client(timeout=600) as client:
            decode_tps(client, url, REFERENCE, "hi", 8)  # warm-up
            names = list(APIS)
            for rnd in range(args.rounds):
                for k, prompt in enumerate(PROMPTS):
                    shift = (rnd * len(PROMPTS) + k) % len(names)
                    for api in names[shift:] + names[:shift]:
                        tps[api].append(decode_tps(client, url, api, prompt, args.max_tokens))
    medians = {api: statistics.median(v) for api, v in tps.items()}
    report: dict[str, dict] = {api: {"decode_tps": v, "ratio_vs_chat": v / medians[REFERENCE]} for api, v in medians.items()}
    cpu = engine_cpu(args.rounds, args.max_tokens)
    report["engine_cpu_ms_per_token"] = {**cpu, "tools_vs_plain": cpu["tools"] / cpu["plain"]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for api in APIS:
        print(f"{api:>10} {report[api]['decode_tps']:7.1f} tok/s  {report[api]['ratio_vs_chat']:.3f}x chat completions")
    print(f"engine thread CPU per token: {cpu['plain']:.2f} ms without tools, {cpu['tools']:.2f} ms with a tool declared "
          f"({cpu['tools'] / cpu['plain']:.3f}x)")


if __name__ == "__main__":
    main()
