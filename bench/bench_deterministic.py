"""What the deterministic mode costs (issue 31): the same server-like engine (4 sequences, the
prompt cache on, speculation "auto") with and without `EngineConfig.deterministic`, and the
default with speculation off (the mode turns it off: this tells what the rest of the mode costs),
on each embedded model, in a fresh engine per round and mode, the order rotating by round so a
machine whose load drifts weighs on all. Per mode, the median over rounds of:

- decode tok/s of one request (128 tokens after a short chat prompt);
- the TTFT of a conversation's second turn (the default reuses the first turn's cells; the
  deterministic mode prefills the whole history again);
- output tok/s of 4 requests sent together (128 tokens each: batched in the default mode, one
  after another in the deterministic one).

Prints the figures and deterministic / default (and / default without speculation) for each.

    python -m bench.bench_deterministic [--rounds 3] [--threads 2] [--model NAME ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from edgechat.config import Paths, get_paths
from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams

MODELS = ["smollm2-135m-instruct", "gemma3-270m"]
TOPICS = ["a lighthouse", "a copper kettle", "the winter market", "a paper boat", "an old violin", "the night train"]
GREEDY = SamplingParams(temperature=0)
TOKENS = 128


def ask(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a long story about {topic}, with its people, the weather and what happens at night."}]


#: name -> (deterministic, speculative)
MODES = {"default": (False, "auto"), "no-spec": (False, "off"), "deterministic": (True, "auto")}


def measure(model: str, mode: str, threads: int, salt: int, data: Path) -> dict:
    deterministic, speculative = MODES[mode]
    # models from the usual cache (Gemma 3 is assembled once), conversations in a scratch folder
    paths = Paths(data=data, cache=get_paths().cache, config=data / "config")
    config = EngineConfig(model=model, n_ctx=2048, n_threads=threads, n_parallel=4, paths=paths,
                          prompt_cache_budget=256 << 20, speculative=speculative, deterministic=deterministic)
    topics = TOPICS[salt % len(TOPICS):] + TOPICS[: salt % len(TOPICS)]  # no round reuses another's prompt
    with Engine(config) as engine:
        one = engine.submit(ChatRequest(messages=ask(topics[0]), sampling=GREEDY, max_tokens=TOKENS, ignore_eos=True)).result()
        turn1 = ask(topics[1])
        first = engine.submit(ChatRequest(messages=turn1, sampling=GREEDY, max_tokens=TOKENS, session="c")).result()
        turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now tell it again, shorter."}]
        second = engine.submit(ChatRequest(messages=turn2, sampling=GREEDY, max_tokens=1, session="c")).result()
        started = time.perf_counter()
        handles = [engine.submit(ChatRequest(messages=ask(t), sampling=GREEDY, max_tokens=TOKENS, ignore_eos=True)) for t in topics[2:6]]
        out = sum(h.result().metrics.completion_tokens for h in handles)
        wall = time.perf_counter() - started
    return {"decode_tps": one.metrics.decode_tps, "turn2_ttft_s": second.metrics.ttft, "concurrent_tps": out / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", action="append", dest="models")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = {}
    for model in args.models or MODELS:
        runs = {mode: [] for mode in MODES}
        names = list(MODES)
        with tempfile.TemporaryDirectory() as scratch:
            for r in range(args.rounds):
                for mode in names[r % len(names):] + names[: r % len(names)]:
                    runs[mode].append(measure(model, mode, args.threads, r, Path(scratch) / f"{r}-{mode}"))
        rows = {}
        for key in runs["default"][0]:
            med = {mode: statistics.median(x[key] for x in runs[mode]) for mode in MODES}
            rows[key] = {**{m: round(v, 3) for m, v in med.items()},
                         "ratio": round(med["deterministic"] / med["default"], 3),
                         "ratio_no_spec": round(med["deterministic"] / med["no-spec"], 3)}
        report[model] = rows
        if not args.json:
            print(f"{model} ({args.rounds} rounds, {args.threads} threads): deterministic vs default (vs default without speculation)")
            for key, row in rows.items():
                print(f"  {key:15} {row['deterministic']:9.3f} vs {row['default']:9.3f} ({row['no-spec']:9.3f})  "
                      f"{row['ratio']:.2f}x ({row['ratio_no_spec']:.2f}x)")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
