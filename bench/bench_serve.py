"""`edgechat serve --parallel 4` against llama.cpp's `llama-server -np 4`, same model, same machine, same run.

Each round starts both servers afresh (only one is loaded at a time; an idle one sleeps) and
measures them in alternating order, so a machine whose load drifts (other work, thermal limits)
weighs on both alike, and each side draws as many processes as the other. The load comes from edgechat's
load generator: SmolLM2-135M Q4_1, 2 threads, 8k context in all (4 sequences of 2048), 128 output
tokens per request, the long-tail prompt mix (20-400 tokens), at concurrency 1 and 4, the same
prompts for both. Prints both reports and the ratios the issue sets as targets:

    conc 4: throughput >= 1.0x llama-server and TTFT p95 <= llama-server's
    conc 1: throughput >= 0.95x llama-server

    python -m bench.bench_serve [--rounds 2] [--requests-c1 4] [--requests-c4 8] [--model PATH] [--json]
    (requests per round and server)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from edgechat.config import get_paths
from edgechat.loadgen import Run, load, summarize
from edgechat.models import resolve_model

MODEL = "smollm2-135m-instruct"
THREADS, CTX_TOTAL, PARALLEL, MAX_TOKENS = 2, 8192, 4, 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], port: int, name: str, log_dir: Path) -> subprocess.Popen:
    """Start a server process (its output appended to `name`.log) and wait until /health answers 200."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return proc
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not become healthy in 120 s; see {log_path}")
            time.sleep(0.2)
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _server(cmd: list[str], port: int, name: str, log_dir: Path):
    """Start a server process, wait until /health answers 200, stop it afterwards."""
    proc = _start(cmd, port, name, log_dir)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests-c1", type=int, default=4)
    ap.add_argument("--requests-c4", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the reports and ratios as JSON")
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    ap.add_argument("--model", default=MODEL, help=f"a GGUF file or model name (default {MODEL})")
    args = ap.parse_args(argv)

    from bench.llamabench import find_llama_server
    from quantize.llm import use_extra_buffers

    model_path = resolve_model(args.model, get_paths())
    plan = [(1, args.requests_c1), (4, args.requests_c4)]
    runs: dict[str, dict[int, list[Run]]] = {"llama-server": {1: [], 4: []}, "edgechat": {1: [], 4: []}}
    for rnd in range(args.rounds):
        llama_port, edge_port = _free_port(), _free_port()
        llama_cmd = [
            str(find_llama_server()), "-m", str(model_path), "-t", str(THREADS), "-tb", str(THREADS),
            "-c", str(CTX_TOTAL), "-np", str(PARALLEL), "--no-webui", "--host", "127.0.0.1", "--port", str(llama_port),
            # the engine keeps weights in plain buffers on AMX CPUs (their repacked matmul faults in
            # some VMs): the reference lays them out alike
            *([] if use_extra_buffers() else ["--no-repack"]),
        ]
        edge_cmd = [
            sys.executable, "-m", "edgechat", "serve", "-m", str(model_path), "--threads", str(THREADS),
            "--ctx", str(CTX_TOTAL // PARALLEL), "--parallel", str(PARALLEL), "--port", str(edge_port),
            "--degrade-queue-wait", "0",
            # llama-server guesses nothing by default: compare batching alone (bench_serve_spec
            # measures speculation)
            "--speculative", "off",
        ]
        # fresh servers each round: a process settles at one of two speeds ~9% apart on this kind
        # of machine (see bench_engine), so each side draws one process per round, not one in all
        with contextlib.ExitStack() as stack:
            urls = {
                "llama-server": stack.enter_context(_server(llama_cmd, llama_port, "llama-server", args.log_dir)),
                "edgechat": stack.enter_context(_server(edge_cmd, edge_port, "edgechat-serve", args.log_dir)),
            }
            order = list(urls) if rnd % 2 == 0 else list(reversed(urls))
            for conc, n in plan:
                for name in order:
                    run = asyncio.run(load(urls[name], conc, n, MAX_TOKENS, seed=args.seed + 1000 * rnd))
                    runs[name][conc].append(run)
                    print(f"round {rnd + 1}/{args.rounds} {name} c{conc}: {sum(r.output_tokens for r in run.results if r.ok) / run.duration_s:.1f} tok/s", file=sys.stderr)
    results = {name: {c: summarize(rs) for c, rs in by_c.items()} for name, by_c in runs.items()}

    ref, ours = results["llama-server"], results["edgechat"]
    ratios = {
        "c1_throughput": ours[1].output_tok_s / ref[1].output_tok_s if ref[1].output_tok_s else 0.0,
        "c4_throughput": ours[4].output_tok_s / ref[4].output_tok_s if ref[4].output_tok_s else 0.0,
        "c4_ttft_p95": ours[4].ttft["p95"] / ref[4].ttft["p95"] if ref[4].ttft["p95"] else 0.0,
    }
    targets = {
        "c1_throughput": ratios["c1_throughput"] >= 0.95,
        "c4_throughput": ratios["c4_throughput"] >= 1.0,
        "c4_ttft_p95": ratios["c4_ttft_p95"] <= 1.0,
    }
    if args.json:
        out = {name: {c: json.loads(r.to_json()) for c, r in reps.items()} for name, reps in results.items()}
        print(json.dumps({"results": out, "ratios": ratios, "targets_met": targets}, indent=2))
    else:
        for name, reps in results.items():
            for report in reps.values():
                print(f"--- {name}\n{report.table()}\n")
        print(f"conc 1 throughput  edgechat/llama-server = {ratios['c1_throughput']:.2f}x  (target >= 0.95x: {'met' if targets['c1_throughput'] else 'MISSED'})")
        print(f"conc 4 throughput  edgechat/llama-server = {ratios['c4_throughput']:.2f}x  (target >= 1.0x: {'met' if targets['c4_throughput'] else 'MISSED'})")
        print(f"conc 4 TTFT p95    edgechat/llama-server = {ratios['c4_ttft_p95']:.2f}x  (target <= 1.0x: {'met' if targets['c4_ttft_p95'] else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
