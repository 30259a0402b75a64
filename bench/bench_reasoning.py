"""What thinking costs (issue 25), on SmolLM2 given a Qwen3-style thinking template (the one
tests/test_reasoning.py writes; no embedded model thinks):

- decode: the same greedy 192 tokens with the reasoning splitter on (the template opens a block,
  so every token passes through it) against the same engine with `split_reasoning` off (the
  text as it is): target >= 0.98x. Runs alternate, the median of their ratios is printed.
- ten turns of one conversation, each turn's thoughts left out of the next prompt: the TTFT of
  turn 10 against turn 2 (prefix reuse must hold while the template drops old thoughts): target
  <= 1.3x.

    python -m bench.bench_reasoning [--rounds 5] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from edgechat.config import Paths, get_paths
from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams

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


def ten_turns(engine: Engine, session: str) -> dict:
    history, ttft, cached = [], [], []
    for turn in range(10):
        history.append({"role": "user", "content": f"Question {turn + 1}: name a city and one thing it is known for."})
        done = engine.submit(ChatRequest(messages=list(history), sampling=GREEDY, max_tokens=48, reasoning_budget=16,
                                         session=session)).result()
        ttft.append(done.metrics.ttft)
        cached.append(done.metrics.cached_tokens)
        history.append({"role": "assistant", "content": done.text})
    return {"ttft": ttft, "cached": cached, "ratio": ttft[9] / ttft[1]}


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
            result = {"decode": decode_ratio(engine, args.rounds), "ten_turns": ten_turns(engine, "thinking")}
        # the reference: the same conversation on SmolLM2's own template (no thoughts to drop),
        # where a turn's TTFT grows with the context alone
        with Engine(dataclasses.replace(config, chat_template=None)) as engine:
            result["ten_turns_plain"] = ten_turns(engine, "plain")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    d, t = result["decode"], result["ten_turns"]
    print(f"decode with the splitter: {d['split_tps']:.1f} t/s, plain {d['plain_tps']:.1f} t/s, "
          f"median paired ratio {d['ratio']:.3f} (target >= 0.98)")
    p = result["ten_turns_plain"]
    print(f"ten turns: TTFT turn 2 {t['ttft'][1] * 1000:.0f} ms, turn 10 {t['ttft'][9] * 1000:.0f} ms, "
          f"ratio {t['ratio']:.2f} (target <= 1.3); cached tokens by turn {t['cached']}")
    print(f"same turns without thinking: turn 2 {p['ttft'][1] * 1000:.0f} ms, turn 10 {p['ttft'][9] * 1000:.0f} ms, "
          f"ratio {p['ratio']:.2f}; cached tokens by turn {p['cached']}")


if __name__ == "__main__":
    main()
