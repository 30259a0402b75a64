"""What thinking costs (issue 25), on SmolLM2 given a Qwen3-style thinking template (the one
tests/test_reasoning.py writes; no embedded model thinks):

- decode: the same greedy 192 tokens with the reasoning splitter on (the template opens a block,
  so every token passes through it) against the same engine with `split_reasoning` off (the
  text as it is): target >= 0.98x. Runs alternate, the median of their ratios is printed.
- ten turns of one conversation, each turn's thoughts left out of the next prompt: the TTFT of
  turn 10 against turn 2 (prefix reuse must hold while the template drops old thoughts): target
  <= 1.3x. Beside it, the floor: the same two turns' new tokens at their depths in one raw
  llama_decode each (a scratch context; flash attention as the engine's, and off), the ratio no
  engine can beat, and the tokens prefilled per turn (constant when prefix reuse holds).

    python -m bench.bench_reasoning [--rounds 5] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from edgechat.config import Paths, get_paths
from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams
from edgechat.engine.llama import Batch, LlamaBackend

MODEL = "smollm2-135m-instruct"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] | trim }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
GREEDY = SamplingParams(temperature=0)
ASK = [{"role": "user", "content": "Think step by step: how does a refrigerator keep food cold?"}]


def decode_ratio(engine: Engine, rounds: int) -> dict:
    ratios, split_tps, plain_tps = [], [], []
    for _ in range(rounds):
        runs = {}
        for split in (True, False):
            done = engine.submit(ChatRequest(messages=ASK, sampling=GREEDY, max_tokens=192, ignore_eos=True,
                                             split_reasoning=split, speculative="off")).result()
            runs[split] = done.metrics.decode_tps
        split_tps.append(runs[True])
        plain_tps.append(runs[False])
        ratios.append(runs[True] / runs[False])
    return {"split_tps": statistics.median(split_tps), "plain_tps": statistics.median(plain_tps), "ratio": statistics.median(ratios)}


def ten_turns(engine: Engine, session: str, rounds: int) -> dict:
    history, ttft, cached, prompts = [], [], [], []
    for turn in range(10):
        history.append({"role": "user", "content": f"Question {turn + 1}: name a city and one thing it is known for."})
        request = ChatRequest(messages=list(history), sampling=GREEDY, max_tokens=48, reasoning_budget=16, session=session)
        prompts.append(engine.prompt_tokens(request))
        done = engine.submit(request).result()
        ttft.append(done.metrics.ttft)
        cached.append(done.metrics.cached_tokens)
        history.append({"role": "assistant", "content": done.text})
    turns = [(prompts[1], cached[1]), (prompts[9], cached[9])]
    return {"ttft": ttft, "cached": cached, "prefilled": [len(p) - c for p, c in zip(prompts, cached)],
            "ratio": ttft[9] / ttft[1],
            "floor": {fa: decode_floor(engine, turns, fa, rounds) for fa in dict.fromkeys((engine.config.flash_attn, "off"))}}


def decode_floor(engine: Engine, turns: list[tuple[list[int], int]], flash_attn: str, rounds: int) -> float:
    """The raw llama_decode of turn 10's new tokens after its cached ones, against turn 2's
    (median of paired ratios), in a scratch context of the engine's shape: what attention over a
    longer cache costs the model itself, whatever the engine does around it."""
    be = LlamaBackend(engine.model_path, n_ctx_total=engine.n_ctx, n_seq_max=1, n_threads=engine.n_threads,
                      flash_attn=flash_attn)
    batch = Batch(max(len(tokens) for tokens, _ in turns), 1)

    def decode(tokens: list[int], start: int) -> float:
        batch.clear()
        for i in range(start, len(tokens)):
            batch.add(tokens[i], i, 0, i == len(tokens) - 1)
        began = time.perf_counter()
        be.decode(batch)
        return time.perf_counter() - began

    def new_tokens(tokens: list[int], cached: int) -> float:
        be.seq_rm(0)
        decode(tokens[:cached], 0)
        return decode(tokens, cached)

    try:
        ratios = []
        for _ in range(rounds):
            shallow, deep = (new_tokens(*turn) for turn in turns)
            ratios.append(deep / shallow)
        return statistics.median(ratios)
    finally:
        batch.close()
        be.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = Paths(data=Path(tmp), cache=get_paths().cache, config=Path(tmp) / "config")
        config = EngineConfig(model=MODEL, n_ctx=4096, n_threads=args.threads, paths=paths, chat_template=TEMPLATE)
        with Engine(config) as engine:
            result = {"decode": decode_ratio(engine, args.rounds), "ten_turns": ten_turns(engine, "thinking", args.rounds)}
        # the reference: the same conversation on SmolLM2's own template (no thoughts to drop),
        # where a turn's TTFT grows with the context alone
        with Engine(dataclasses.replace(config, chat_template=None)) as engine:
            result["ten_turns_plain"] = ten_turns(engine, "plain", args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    d = result["decode"]
    print(f"decode with the splitter: {d['split_tps']:.1f} t/s, plain {d['plain_tps']:.1f} t/s, "
          f"median paired ratio {d['ratio']:.3f} (target >= 0.98)")
    for label, t in (("ten turns", result["ten_turns"]), ("same turns without thinking", result["ten_turns_plain"])):
        floor = ", ".join(f"{r:.2f} (flash attention {fa})" for fa, r in t["floor"].items())
        print(f"{label}: TTFT turn 2 {t['ttft'][1] * 1000:.0f} ms, turn 10 {t['ttft'][9] * 1000:.0f} ms, "
              f"ratio {t['ratio']:.2f} (target <= 1.3); raw llama_decode of the same new tokens at the same depths: "
              f"{floor}; cached tokens by turn {t['cached']}, prefilled {t['prefilled']}")


if __name__ == "__main__":
    main()
