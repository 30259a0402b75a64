"""What each API's translator costs a streamed answer (issue 26): decode tok/s through OpenAI's
Responses API (`/v1/responses`), Anthropic's Messages (`/v1/messages`) and Ollama's chat
(`/api/chat`) against `/v1/chat/completions`, on one `edgechat serve` (SmolLM2-135M, 2 threads,
one sequence, speculation off: every API gets the same process and the same greedy tokens).

Each request is streamed and parsed as a client would (every event's JSON read); its decode
tok/s is (output tokens - 1) / (last event - first text event), the output tokens from the
API's own usage. Rounds go through the prompts and, for each, the APIs in an order that
rotates, so a busy machine weighs on all alike. Reported: each API's median and its ratio to
chat completions' (target >= 0.98x).

    python -m bench.bench_apis [--rounds 3] [--max-tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_serve import _free_port, _server

MODEL = "smollm2-135m-instruct"
#: prompts SmolLM2 answers at length, so every API streams max_tokens tokens
PROMPTS = ["Describe a city you like.", "Write a note to a friend about a trip.", "Explain what a compiler does."]
REFERENCE = "chat"


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
    report = {api: {"decode_tps": v, "ratio_vs_chat": v / medians[REFERENCE]} for api, v in medians.items()}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for api, r in report.items():
        print(f"{api:>10} {r['decode_tps']:7.1f} tok/s  {r['ratio_vs_chat']:.3f}x chat completions")


if __name__ == "__main__":
    main()
