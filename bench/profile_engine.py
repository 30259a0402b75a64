"""Where an engine step's time goes: `llama_decode` against everything else, per step, at 1 and 4
concurrent requests.

Drives the Engine in this process on a GGUF (by default the real Qwen2.5-Coder-0.5B-Instruct
Q4_K_M, bench/realmodel.py): `--concurrency` requests at once, each a short prompt and
`--tokens` generated tokens (ignore_eos), with the load test's sampling (temperature 0.7) or
greedy. Timers wrap the engine thread's step and the runner's calls in it, so each step splits
into: `llama_decode`; sampling (the native sampler chain, or argmax for greedy); logits reads
(views of llama.cpp's buffer, copies kept after a prompt); planning (`Scheduler.schedule`:
batch building); and the rest of `update` (detokenizing, stop strings, events). The time of the
engine thread outside steps (its queue, admission) is reported too. `--cprofile` adds the
engine thread's 20 most expensive functions (own time) during steps.

    python -m bench.profile_engine [--model PATH] [--concurrency 1 4] [--tokens 128] [--greedy] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams

PARTS = ("decode", "sample", "logits", "schedule", "update_rest", "step_rest")


class Clock:
    """Seconds spent in wrapped calls by label, each call's own time only (a wrapped call inside
    another counts for its own label, not for both: argmax reads the logits, update samples)."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._inner: list[float] = []  # per open call: the time of the wrapped calls inside it

    def wrap(self, obj, name: str, label: str):
        inner = getattr(obj, name)

        def timed(*args, **kw):
            self._inner.append(0.0)
            started = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                took = time.perf_counter() - started
                self.total[label] += took - self._inner.pop()
                self.calls[label] += 1
                if self._inner:
                    self._inner[-1] += took

        setattr(obj, name, timed)


def profile(model: Path, concurrency: int, tokens: int, threads: int, greedy: bool, with_cprofile: bool) -> dict:
    config = EngineConfig(model=str(model), n_ctx=1024, n_parallel=concurrency, n_threads=threads, speculative="off")
    sampling = SamplingParams(temperature=0) if greedy else SamplingParams(temperature=0.7, seed=1)
    with Engine(config) as engine:
        def batch_of_requests(salt: int) -> float:
            started = time.perf_counter()
            handles = [engine.submit(ChatRequest(messages=[{"role": "user", "content": f"Write a long story about a city, number {salt * 10 + i}."}],
                                                 sampling=sampling, max_tokens=tokens, ignore_eos=True)) for i in range(concurrency)]
            for h in handles:
                h.result(timeout=600)
            return time.perf_counter() - started

        batch_of_requests(0)  # warm-up: weights paged in, buffers made
        clock = Clock()
        sched, runner = engine.scheduler, engine.backend
        for name in ("decode", "sample", "argmax"):
            clock.wrap(runner, name, "sample" if name == "argmax" else name)
        clock.wrap(runner, "logits", "logits")
        clock.wrap(sched, "schedule", "schedule")
        clock.wrap(sched, "update", "update")
        clock.wrap(sched, "step", "step")
        prof = cProfile.Profile() if with_cprofile else None
        step = sched.step

        def profiled_step():
            assert prof is not None
            prof.enable()
            try:
                return step()
            finally:
                prof.disable()

        if prof is not None:
            sched.step = profiled_step
        wall = batch_of_requests(1)
    t, n = clock.total, max(clock.calls["step"], 1)
    parts = dict(zip(PARTS, (t["decode"], t["sample"], t["logits"], t["schedule"], t["update"], t["step"]), strict=True))
    whole = sum(parts.values())
    row = {
        "model": model.name, "concurrency": concurrency, "tokens_per_request": tokens, "threads": threads,
        "sampling": "greedy" if greedy else "temperature 0.7", "steps": clock.calls["step"], "wall_s": wall,
        "tok_s": concurrency * tokens / wall, "step_ms": 1000 * whole / n,
        "outside_steps_ms": 1000 * (wall - whole) / n,
        "per_step_ms": {k: 1000 * v / n for k, v in parts.items()},
        "share_of_step": {k: v / whole for k, v in parts.items()},
    }
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        row["cprofile"] = out.getvalue()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the real Qwen2.5-Coder-0.5B, fetched once)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy", action="store_true", help="temperature 0 (argmax) instead of 0.7 (the native sampler chain)")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.model is None:
        from bench.realmodel import real_model_path

        args.model = real_model_path()
    rows = [profile(args.model, c, args.tokens, args.threads, args.greedy, args.cprofile) for c in args.concurrency]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.model.name}, {args.threads} threads, {rows[0]['sampling']}, {args.tokens} tokens per request")
    print(f"{'conc':>4} {'tok/s':>7} {'step ms':>8} {'outside':>8}  " + "  ".join(f"{p:>11}" for p in PARTS))
    for r in rows:
        cells = "  ".join(f"{r['per_step_ms'][p]:6.2f} {100 * r['share_of_step'][p]:3.0f}%" for p in PARTS)
        print(f"{r['concurrency']:>4} {r['tok_s']:7.1f} {r['step_ms']:8.2f} {r['outside_steps_ms']:8.2f}  {cells}")
    for r in rows:
        if "cprofile" in r:
            print(f"--- concurrency {r['concurrency']}: engine thread during steps, by own time\n{r['cprofile']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
