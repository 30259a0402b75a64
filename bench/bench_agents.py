"""What agent features cost per generated token (issue 13): a grammar in the sampler chain
(response_format json_schema, and a required tool call) and logprobs, against plain decoding
of the same prompts in the same process, rounds interleaved so a busy machine hurts all alike.

Plain greedy takes the argmax of the logits; a grammar needs the native chain (llama.cpp checks
every candidate token against the grammar's stacks), logprobs a log-softmax over the vocabulary
in numpy. Reported: decode tok/s of each and its ratio to plain.

    python -m bench.bench_agents [--model smollm2-135m-instruct] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from edgechat.config import get_paths
from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.engine.request import SamplingParams
from edgechat.server.schemas import parse_chat

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
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
