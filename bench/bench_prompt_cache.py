"""The prompt cache (issue 13): the same 16 prompts (20-400 tokens, the long-tail mix) sent twice at
4 clients to `edgechat serve --parallel 4` (`--cache-ram` at its default), to llama-server
`-np 4 --cache-ram 8192` (its default) and to `edgechat serve --cache-ram 0` (the cold-pass
reference). 16 distinct prompts through 4 sequences: on the second pass, a server that keeps only
what its sequences hold reuses almost nothing; a prompt cache restores every prompt.

Same settings as bench_serve (SmolLM2-135M Q4_1, 2 threads, 4 sequences of 2048 tokens,
speculation off) but 32 output tokens per request by default: agent calls send long contexts and
get short answers (a tool call), and with 128 the decode hides what prefill costs. Each round
starts fresh servers (an idle one sleeps) and runs the cold passes, then the warm ones
(`--warm-passes` of them: each sends the same prompts again), in an order that rotates by round,
so a machine whose load drifts weighs on all alike. The ratios compare the median pass of each
side: on 2 cores, another process can stall llama.cpp's threads for seconds (a warm pass of
either server fell to a quarter of its speed once here), and one such pass must not decide a
target. Prints output tok/s (median pass, and all passes pooled) and TTFT p50, the median of the
warm passes' ratios to llama-server's pass next to each (the machine's drift cancels within a pair),
and the targets:

    edgechat warm pass >= 1.0x llama-server's warm pass
    edgechat cold pass with the cache ~ 1.0x without it (saving states costs the first pass nothing)

    python -m bench.bench_prompt_cache [--rounds 2] [--warm-passes 3] [--max-tokens 32] [--model PATH] [--json]

`--restart` measures the prompt cache on disk instead: an 800-token system prompt and a short
question, answered with one token (its latency is the time to first token) by a fresh
`edgechat serve` on an empty data folder (cold), again by the same process (warm, RAM), then by
the server restarted after SIGTERM; and in a second fresh folder, cold again, then after
`kill -9` once the background write is on disk. Prints the median of each and the cached
tokens, with the target:

    after a SIGTERM restart and after kill -9: TTFT <= 0.1x of cold

    python -m bench.bench_prompt_cache --restart [--rounds 3] [--model PATH] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_serve import (
    CTX_TOTAL,
    MODEL,
    PARALLEL,
    THREADS,
    _free_port,
    _server,
    _start,
    _stop,
)
from edgechat.config import get_paths
from edgechat.loadgen import Run, load, make_prompt, prompt_token_targets, summarize
from edgechat.models import resolve_model

N_PROMPTS, CONCURRENCY = 16, 4
SERVERS = ("edgechat", "llama-server", "edgechat-off")


def prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [make_prompt(t, rng) for t in prompt_token_targets(N_PROMPTS, rng)]


def commands(name: str, port: int, model_path: Path) -> list[str]:
    if name == "llama-server":
        return [
            str(_llama_server()), "-m", str(model_path), "-t", str(THREADS), "-tb", str(THREADS), "-c", str(CTX_TOTAL),
            "-np", str(PARALLEL), "--cache-ram", "8192", "--no-webui", "--host", "127.0.0.1", "--port", str(port),
        ]
    cmd = [
        sys.executable, "-m", "edgechat", "serve", "-m", str(model_path), "--threads", str(THREADS), "--ctx", str(CTX_TOTAL // PARALLEL),
        "--parallel", str(PARALLEL), "--port", str(port), "--degrade-queue-wait", "0", "--speculative", "off",
    ]
    return cmd + (["--cache-ram", "0"] if name == "edgechat-off" else [])


def _llama_server() -> Path:
    from bench.llamabench import find_llama_server

    return find_llama_server()


def pass_tps(run: Run) -> float:
    return sum(r.output_tokens for r in run.results if r.ok) / run.duration_s


def prompt_cache_counts(url: str) -> dict[str, float]:
    """edgechat's prompt cache counters from /metrics (llama-server has none of these names)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = r"^edgechat_prompt_cache_(hits|misses|restored_tokens|bytes|entries)(?:_total)? (\S+)$"
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


#: the restart mode's system prompt, as the load generator's token target: ~800 prompt tokens
#: with Qwen2.5's tokenizer and chat template (its words are longer than it reckons)
RESTART_PREFIX = 970


def one_token(url: str, messages: list[dict]) -> tuple[float, int, int]:
    """(seconds to a 1-token answer, prompt tokens, cached prompt tokens)."""
    started = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={"messages": messages, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    usage = r.json()["usage"]
    return time.perf_counter() - started, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def restart(model_path: Path, rounds: int, seed: int, log_dir: Path) -> dict:
    """Cold, warm, after SIGTERM and after kill -9 (see the module doc), `rounds` times."""
    messages = [{"role": "system", "content": make_prompt(RESTART_PREFIX, random.Random(seed))},
                {"role": "user", "content": "Summarize the text above in one sentence."}]
    times: dict[str, list[float]] = {"cold": [], "warm": [], "sigterm": [], "kill-9": []}
    cached: dict[str, list[int]] = {k: [] for k in times}
    prompt_tokens = 0

    def measure(phase: str, url: str) -> None:
        nonlocal prompt_tokens
        took, prompt_tokens, hit = one_token(url, messages)
        times[phase].append(took)
        cached[phase].append(hit)
        print(f"{phase}: {took:.3f} s, {hit} of {prompt_tokens} prompt tokens cached", file=sys.stderr)

    for _ in range(rounds):
        for stop_with in ("sigterm", "kill-9"):
            with tempfile.TemporaryDirectory(prefix="bench-restart-") as data:
                port = _free_port()
                cmd = commands("edgechat", port, model_path) + ["--data-dir", data]
                proc = _start(cmd, port, "edgechat-restart", log_dir)
                try:
                    measure("cold", f"http://127.0.0.1:{port}")
                    if stop_with == "sigterm":
                        measure("warm", f"http://127.0.0.1:{port}")
                        proc.send_signal(signal.SIGTERM)
                    else:
                        files = Path(data) / "snapshots" / "prompts"
                        deadline = time.monotonic() + 60
                        while not any(files.glob("*.kv")) and time.monotonic() < deadline:
                            time.sleep(0.05)  # the background write, a moment after the answer
                        proc.kill()
                    proc.wait(timeout=120)
                finally:
                    if proc.poll() is None:
                        _stop(proc)
                proc = _start(cmd, port, "edgechat-restart", log_dir)
                try:
                    measure(stop_with, f"http://127.0.0.1:{port}")
                finally:
                    _stop(proc)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": model_path.name, "prompt_tokens": prompt_tokens, "ttft_s": times, "cached_tokens": cached, "median_ttft_s": med,
        "ratios": {"sigterm_vs_cold": med["sigterm"] / med["cold"], "kill_9_vs_cold": med["kill-9"] / med["cold"], "warm_vs_cold": med["warm"] / med["cold"]},
    }


def print_restart(out: dict) -> None:
    print(f"{out['model']}: {out['prompt_tokens']} prompt tokens, a 1-token answer; median of {len(out['ttft_s']['cold'])} cold starts")
    for phase, value in out["median_ttft_s"].items():
        print(f"{phase:8} {value:8.3f} s   cached {out['cached_tokens'][phase]}")
    for name, value in out["ratios"].items():
        mark = f"  (target <= 0.1x: {'met' if value <= 0.1 else 'MISSED'})" if name != "warm_vs_cold" else ""
        print(f"{name:16} {value:.3f}x{mark}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm-passes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    ap.add_argument("--model", default=MODEL, help=f"a GGUF file or model name (default {MODEL})")
    ap.add_argument("--restart", action="store_true", help="TTFT of an 800-token prefix after restarts (see above)")
    args = ap.parse_args(argv)

    model_path = resolve_model(args.model, get_paths())
    if args.restart:
        out = restart(model_path, args.rounds, args.seed, args.log_dir)
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print_restart(out)
        return 0
    runs: dict[str, dict[str, list[Run]]] = {name: {"cold": [], "warm": []} for name in SERVERS}
    counts: list[dict] = []
    for rnd in range(args.rounds):
        texts = prompts(args.seed + rnd)
        order = SERVERS[rnd % 3 :] + SERVERS[: rnd % 3]
        with contextlib.ExitStack() as stack:
            urls = {}
            for name in order:
                port = _free_port()
                urls[name] = stack.enter_context(_server(commands(name, port, model_path), port, name, args.log_dir))
            for phase in ["cold"] + ["warm"] * args.warm_passes:
                for name in order:
                    run = asyncio.run(load(urls[name], CONCURRENCY, N_PROMPTS, args.max_tokens, seed=args.seed, prompts=texts, warmup=1 if phase == "cold" else 0))
                    runs[name][phase].append(run)
                    print(f"round {rnd + 1}/{args.rounds} {name} {phase}: {pass_tps(run):.1f} tok/s", file=sys.stderr)
            counts.append(prompt_cache_counts(urls["edgechat"]))
    results = {name: {phase: summarize(rs) for phase, rs in by_phase.items()} for name, by_phase in runs.items()}

    def tps(name: str, phase: str) -> float:
        return statistics.median(pass_tps(run) for run in runs[name][phase])

    ratios = {
        "warm_vs_llama_server_warm": tps("edgechat", "warm") / tps("llama-server", "warm"),
        # each warm pass against llama-server's pass run next to it: the machine's drift over a
        # run (here a pass of either server swung 15%) weighs on both sides of each pair alike
        "warm_vs_llama_server_warm_paired": statistics.median(
            pass_tps(a) / pass_tps(b) for a, b in zip(runs["edgechat"]["warm"], runs["llama-server"]["warm"], strict=True)
        ),
        "cold_with_cache_vs_without": tps("edgechat", "cold") / tps("edgechat-off", "cold"),
        "edgechat_warm_vs_cold": tps("edgechat", "warm") / tps("edgechat", "cold"),
        "llama_server_warm_vs_cold": tps("llama-server", "warm") / tps("llama-server", "cold"),
        "edgechat_off_warm_vs_cold": tps("edgechat-off", "warm") / tps("edgechat-off", "cold"),
    }
    targets = {"warm_vs_llama_server_warm": ratios["warm_vs_llama_server_warm"] >= 1.0, "cold_with_cache_vs_without": ratios["cold_with_cache_vs_without"] >= 0.95}
    if args.json:
        out = {name: {phase: json.loads(r.to_json()) for phase, r in reps.items()} for name, reps in results.items()}
        passes = {name: {phase: [pass_tps(run) for run in rs] for phase, rs in by_phase.items()} for name, by_phase in runs.items()}
        print(json.dumps({"results": out, "pass_tok_s": passes, "ratios": ratios, "targets_met": targets, "edgechat_prompt_cache": counts}, indent=2))
        return 0
    print(f"{'':14}{'cold tok/s':>12}{'warm tok/s':>12}{'warm pooled':>13}{'cold TTFT p50':>15}{'warm TTFT p50':>15}")
    for name in SERVERS:
        cold, warm = results[name]["cold"], results[name]["warm"]
        print(f"{name:14}{tps(name, 'cold'):12.1f}{tps(name, 'warm'):12.1f}{warm.output_tok_s:13.1f}{cold.ttft['p50']:14.3f}s{warm.ttft['p50']:14.3f}s")
    for name, value in ratios.items():
        mark = f"  (target: {'met' if targets[name] else 'MISSED'})" if name in targets else ""
        print(f"{name:28} {value:.2f}x{mark}")
    for i, c in enumerate(counts):
        print(f"edgechat round {i + 1} prompt cache: {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
