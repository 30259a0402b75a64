"""What agent features cost per generated token (issue 13): a grammar in the sampler chain
(response_format json_schema, and a required tool call) and logprobs, against plain decoding
of the same prompts in the same process, rounds interleaved so a busy machine hurts all alike.

Plain greedy takes the argmax of the logits; a grammar needs the native chain (llama.cpp checks
every candidate token against the grammar's stacks), logprobs a log-softmax over the vocabulary
in numpy. Reported: decode tok/s of each and its ratio to plain.

--isolation: 4 agent clients (back to back, 96 tokens each) and 1 interactive chat against
`edgechat serve --parallel 4`, once with one queue for all and once with priority classes
(interactive=1, agent=3); the chat's TTFT p50/p95 in each, beside the chat alone (idle).

    python -m bench.bench_agents [--model smollm2-135m-instruct] [--rounds 3] [--json]
    python -m bench.bench_agents --isolation [--chats 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from edgechat.config import get_paths
from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.engine.types.metrics import percentile
from edgechat.loadgen import _one
from edgechat.params import SamplingParams
from edgechat.server.openai_chat_api import parse_chat

PROMPTS = ["Describe a city you like.", "Write a note to a friend about a trip.", "Explain what a compiler does."]
#: long enough a string that the answer runs to max_tokens in every variant
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "text": {"type": "string"}}, "required": ["title", "text"]}
TOOL = {"type": "function", "function": {"name": "write_note", "parameters": SCHEMA}}


def variants(prompt: str) -> dict[str, ChatRequest]:
    user = [{"role": "user", "content": prompt}]
    bodies = {
        "plain": {"messages": user},
        "json_schema": {"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}}},
        "tool_required": {"messages": user, "tools": [TOOL], "tool_choice": "required"},
        "logprobs_top5": {"messages": user, "logprobs": True, "top_logprobs": 5},
    }
    out = {}
    for name, body in bodies.items():
        # the server's own parsing: the same grammar and messages a client would get
        req = parse_chat({**body, "max_tokens": 64, "temperature": 0, "speculative": "off"}).request
        req.sampling = SamplingParams(temperature=0)
        out[name] = req
    return out


AGENTS, AGENT_TOKENS, CHAT_TOKENS = 4, 96, 8


async def _chat_ttfts(url: str, model: str, chats: int, agents: int, isolated: bool) -> list[float]:
    """TTFT of `chats` interactive chats, one after another, while `agents` clients keep asking."""
    base = f"{url}/v1"
    stop = asyncio.Event()

    async def agent(i: int) -> None:
        headers = {"X-Priority": "agent"} if isolated else {}
        async with httpx.AsyncClient(timeout=600, headers=headers) as client:
            n = 0
            while not stop.is_set():
                await _one(client, base, model, f"Agent {i} step {n}: plan the next call.", 0, AGENT_TOKENS, n)
                n += 1

    tasks = [asyncio.create_task(agent(i)) for i in range(agents)]
    ttfts = []
    headers = {"X-Priority": "interactive"} if isolated else {}
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        if agents:
            await asyncio.sleep(2.0)  # the agents hold their sequences first
        for k in range(chats):
            result = await _one(client, base, model, f"Hi, question {k}: what is a good name for a cat?", 0, CHAT_TOKENS, k)
            assert result.error is None, result.error
            ttfts.append(result.ttft)
    stop.set()
    await asyncio.gather(*tasks)
    return ttfts


def isolation(model: str, chats: int, log_dir: Path) -> dict:
    from bench.bench_serve import _free_port, _server

    out = {}
    for name, extra, agents in (
        ("idle", [], 0),
        ("one_queue", [], AGENTS),
        ("isolated", ["--priority-class", "interactive=1", "--priority-class", "agent=3"], AGENTS),
    ):
        port = _free_port()
        cmd = [sys.executable, "-m", "edgechat", "serve", "-m", model, "--threads", "2", "--parallel", "4", "--ctx", "1024",
               "--port", str(port), "--degrade-queue-wait", "0", *extra]
        with _server(cmd, port, f"agents-{name}", log_dir) as url:
            ttfts = asyncio.run(_chat_ttfts(url, model, chats, agents, bool(extra)))
        ttfts.sort()
        out[name] = {"ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95)}
    for r in out.values():
        r["p95_vs_idle"] = r["ttft_p95_s"] / out["idle"]["ttft_p95_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--isolation", action="store_true", help="the interactive chat's TTFT under agent load, with and without priority classes")
    ap.add_argument("--chats", type=int, default=12)
    args = ap.parse_args()
    if args.isolation:
        with tempfile.TemporaryDirectory() as tmp:
            report = isolation(args.model, args.chats, Path(tmp))
        if args.json:
            print(json.dumps(report, indent=2))
            return
        for name, r in report.items():
            print(f"{name:>10}  chat TTFT p50 {r['ttft_p50_s']:6.3f} s  p95 {r['ttft_p95_s']:6.3f} s  ({r['p95_vs_idle']:.1f}x idle p95)")
        return
    tps: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with Engine(EngineConfig(model=args.model, n_ctx=2048, n_threads=2, paths=get_paths(tmp))) as engine:
            engine.submit(ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=4)).result()  # warm-up
            for _ in range(args.rounds):
                for prompt in PROMPTS:
                    for name, req in variants(prompt).items():
                        tps.setdefault(name, []).append(engine.submit(req).result().metrics.decode_tps)
    rows = {name: statistics.median(v) for name, v in tps.items()}
    report = {name: {"decode_tps": v, "ratio_vs_plain": v / rows["plain"]} for name, v in rows.items()}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name, r in report.items():
        print(f"{name:>14} {r['decode_tps']:7.1f} tok/s  {r['ratio_vs_plain']:.2f}x plain")


if __name__ == "__main__":
    main()
