"""`edgechat serve --parallel 4` with speculative decoding (`--speculative auto`) against without
it (`off`), same model, same machine, same run (issue 11).

Each round starts a fresh server per mode (one at a time, in alternating order, so drift in the
machine's load weighs on both alike) and loads it with 4 concurrent clients twice: grounded
prompts (bench_spec's pasted text to rewrite, code to fix, a document to quote), where n-gram
lookup pays, and the load generator's open prompts (a story from a list of words), where it has
nothing to find. Same settings as bench_serve: SmolLM2-135M, 2 threads, 4 sequences of 2048,
128 output tokens per request, sampled. Prints the reports, the draft acceptance from the
server's Prometheus counters, and the ratios the issue sets as targets:

    grounded: throughput auto >= 1.2x off
    open:     throughput auto >= 0.98x off

    python -m bench.bench_serve_spec [--rounds 2] [--requests 8] [--json]
    (requests per round, mode and workload)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import httpx

from bench.bench_serve import (
    CTX_TOTAL,
    MAX_TOKENS,
    MODEL,
    PARALLEL,
    THREADS,
    _free_port,
    _server,
)
from bench.bench_spec import TASKS
from edgechat.loadgen import Run, load, summarize

MODES = ["auto", "off"]
CONCURRENCY = 4
#: None: the load generator's own open-ended mix
WORKLOADS = {"grounded": [p for task, p in TASKS.items() if task != "open"], "open": None}
TARGETS = {"grounded": 1.2, "open": 0.98}


def _draft_counters(url: str) -> tuple[float, float]:
    """(drafted, accepted) tokens so far, from the server's Prometheus text."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("edgechat_draft_tokens_total", "edgechat_draft_accepted_tokens_total"):
            values[name] = float(value)
    return values.get("edgechat_draft_tokens_total", 0.0), values.get("edgechat_draft_accepted_tokens_total", 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the reports and ratios as JSON")
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    args = ap.parse_args(argv)

    runs: dict[str, dict[str, list[Run]]] = {mode: {w: [] for w in WORKLOADS} for mode in MODES}
    drafts = {mode: {w: [0.0, 0.0] for w in WORKLOADS} for mode in MODES}
    for rnd in range(args.rounds):
        for mode in MODES if rnd % 2 == 0 else list(reversed(MODES)):
            port = _free_port()
            cmd = [
                sys.executable, "-m", "edgechat", "serve", "-m", MODEL, "--threads", str(THREADS),
                "--ctx", str(CTX_TOTAL // PARALLEL), "--parallel", str(PARALLEL), "--port", str(port),
                "--degrade-queue-wait", "0", "--speculative", mode,
            ]  # fmt: skip
            with contextlib.ExitStack() as stack:
                url = stack.enter_context(_server(cmd, port, f"edgechat-serve-{mode}", args.log_dir))
                for workload, prompts in WORKLOADS.items():
                    before = _draft_counters(url)
                    run = asyncio.run(load(url, CONCURRENCY, args.requests, MAX_TOKENS, seed=args.seed + 1000 * rnd, prompts=prompts))
                    after = _draft_counters(url)
                    runs[mode][workload].append(run)
                    for i in range(2):
                        drafts[mode][workload][i] += after[i] - before[i]
                    tok_s = sum(r.output_tokens for r in run.results if r.ok) / run.duration_s
                    print(f"round {rnd + 1}/{args.rounds} {mode} {workload}: {tok_s:.1f} tok/s", file=sys.stderr)
    results = {mode: {w: summarize(rs) for w, rs in by_w.items()} for mode, by_w in runs.items()}

    ratios = {
        w: results["auto"][w].output_tok_s / results["off"][w].output_tok_s if results["off"][w].output_tok_s else 0.0
        for w in WORKLOADS
    }
    acceptance = {w: drafts["auto"][w][1] / drafts["auto"][w][0] if drafts["auto"][w][0] else 0.0 for w in WORKLOADS}
    met = {w: ratios[w] >= TARGETS[w] for w in WORKLOADS}
    if args.json:
        out = {mode: {w: json.loads(r.to_json()) for w, r in reps.items()} for mode, reps in results.items()}
        print(json.dumps({"results": out, "drafts": drafts, "ratios": ratios, "acceptance": acceptance, "targets_met": met}, indent=2))
        return 0
    for mode, reps in results.items():
        for workload, report in reps.items():
            print(f"--- {mode} {workload}\n{report.table()}\n")
    for w in WORKLOADS:
        drafted = drafts["auto"][w][0]
        print(f"{w:8} throughput auto/off = {ratios[w]:.2f}x  (target >= {TARGETS[w]}x: {'met' if met[w] else 'MISSED'}); "
              f"auto drafted {drafted:.0f} tokens, accepted {acceptance[w]:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
