"""Prompt building cost against the number of messages (issue 10: linear, not quadratic).

For 10 / 100 / 1,000 / 10,000 one-line messages, the time to turn a request into prompt tokens on
the real SmolLM2 template and tokenizer (what `submit` does on the caller's thread), as a whole and
per message. The reference is the same engine at 100 messages: with linear building the per-message
cost stays flat, so the ratio at 10,000 stays near 1 (it was ~20x when every prefix was rendered).
Measured: a stateless request of messages never seen (the server's case: built whole, no
eviction; llama.cpp's tokenizer is most of it), the same request resent (an agent resending its
history: remembered tokens), and a session that must evict down to its context. Target: 10,000
messages in well under a second.

    python -m bench.bench_prompt [--model smollm2-135m-instruct] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial

from edgechat.config import get_paths
from edgechat.engine import ChatRequest, ContextPolicy, Engine, EngineConfig

SIZES = (10, 100, 1000, 10000)


def messages(n: int, tag: str = "") -> list[dict]:
    msgs = [{"role": "system", "content": "You are a concise assistant."}]
    for i in range(n - 1):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {tag}{i}: the weather is mild today."})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "And tomorrow?"})
    return msgs


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(model=args.model, n_ctx=2048, n_threads=2, paths=get_paths(tmp))
        with Engine(config) as engine:
            rows = []
            build = engine.prompts.prepare
            build(ChatRequest(messages=messages(2, "warm-up"), session="warm-up"), ContextPolicy.SHIFT)  # hashes the model once
            for n in SIZES:
                # messages never seen (nothing remembered), then the same again (an agent resending its history)
                stateless = ChatRequest(messages=messages(n, "cold"))
                whole = timed(partial(build, stateless, ContextPolicy.SHIFT, check_limit=False), 1)
                again = timed(partial(build, stateless, ContextPolicy.SHIFT, check_limit=False), 3)
                session = ChatRequest(messages=messages(n, "session"), session="bench")
                fitted = timed(partial(build, session, ContextPolicy.SHIFT), 1)
                n = len(stateless.messages)
                rows.append({"messages": n, "stateless_s": whole, "repeat_s": again, "session_s": fitted,
                             "stateless_us_per_msg": whole / n * 1e6, "repeat_us_per_msg": again / n * 1e6,
                             "session_us_per_msg": fitted / n * 1e6})
    ref = rows[1]
    for row in rows:
        row["per_msg_ratio_vs_100"] = row["stateless_us_per_msg"] / ref["stateless_us_per_msg"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'messages':>9} {'new':>10} {'per msg':>9} {'resent':>9} {'per msg':>8} {'session':>9} {'per msg':>8} {'per-msg ratio vs 100':>21}")
    for r in rows:
        print(f"{r['messages']:>9} {r['stateless_s'] * 1000:>8.1f}ms {r['stateless_us_per_msg']:>7.1f}us "
              f"{r['repeat_s'] * 1000:>7.1f}ms {r['repeat_us_per_msg']:>6.1f}us "
              f"{r['session_s'] * 1000:>7.1f}ms {r['session_us_per_msg']:>6.1f}us {r['per_msg_ratio_vs_100']:>21.2f}")


if __name__ == "__main__":
    main()
