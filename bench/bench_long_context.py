"""Long context (issue 38): a ~16,000-token prompt in a 32k context, `edgechat serve` against
llama-server on the same file (default the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M), the same
threads, one sequence, flash attention on (llama.cpp needs it for a quantized V cache), the
prompt cache off on both (`--cache-ram 0`: the figure is the model's own memory), per KV type
(`--kv-type` / `-ctk -ctv`). Each server is started fresh for its one request and stopped after;
who goes first alternates by KV type.

The prompt: this repository's engine sources concatenated, cut at the first line end past
`--prompt-tokens` (llama-server's /tokenize; both servers tokenize with the file's vocabulary),
sent as a raw `/completion` (no template), greedy, `ignore_eos`, `--gen` tokens, streamed.
Measured per side: time to first token at the client, decode tokens/s at that depth (the tokens
after the first over the time from the first event to the last), each server's own `timings`
beside them, and the serving process's peak RSS (VmHWM in /proc/PID/status) against the
planner's estimate for that context and KV type (`edgechat serve`'s /api/ps `size`, what the
planner counts: weights, KV cache, compute, tokenizer), and less what the same server holds with
its model unloaded (keep_alive 0): the planner plans against the memory the OS has free, which the
running process already left out. Both sides answer a 1-token request first (edgechat's loads
the model again). Targets:

    TTFT <= 1.0x llama-server's, decode >= 1.0x; the model's peak RSS within 5% of the estimate

    python -m bench.bench_long_context [--model PATH] [--kv-types f16,q8_0] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.bench_infill import ROOT, source_file
from bench.bench_lifecycle import unload
from bench.bench_serve import _free_port, _start, _stop
from bench.realmodel import real_model_path

SERVERS = ("edgechat", "llama-server")
#: the prompt's text: every engine module, in path order
PROMPT_SOURCES = tuple(str(p.relative_to(ROOT)) for p in sorted((ROOT / "edgechat" / "engine").rglob("*.py")))
#: a 16,000-token prefill takes minutes on 2 cores
REQUEST_TIMEOUT_S = 3600


@dataclass
class Side:
    server: str
    kv_type: str
    prompt_tokens: int
    ttft_s: float
    decode_tps: float
    generated: int
    #: the server's own timings: prefill and decode tokens/s
    server_prefill_tps: float
    server_decode_tps: float
    #: /proc/PID/status of the serving process after the answer, bytes
    vm_hwm: int
    rss_anon: int
    rss_file: int
    #: VmRSS once loaded, before the request; edgechat's with its model unloaded
    rss_loaded: int
    rss_unloaded: int | None


def proc_status(pid: int) -> dict[str, int]:
    """The memory lines of /proc/PID/status, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


def commands(name: str, port: int, model: Path, ctx: int, threads: int, kv_type: str) -> list[str]:
    if name == "llama-server":
        from bench.llamabench import find_llama_server
        from quantize.llm import use_extra_buffers

        return [str(find_llama_server()), "-m", str(model), "-c", str(ctx), "-np", "1", "-t", str(threads), "-tb", str(threads),
                "-ctk", kv_type, "-ctv", kv_type, "-fa", "on", "--cache-ram", "0", "--no-webui", "--host", "127.0.0.1",
                "--port", str(port), *([] if use_extra_buffers() else ["--no-repack"])]
    return [sys.executable, "-m", "edgechat", "serve", "-m", str(model), "--ctx", str(ctx), "--parallel", "1",
            "--threads", str(threads), "--kv-type", kv_type, "--flash-attn", "on", "--cache-ram", "0",
            "--speculative", "off", "--degrade-queue-wait", "0", "--timeout", str(REQUEST_TIMEOUT_S), "--port", str(port)]


def complete(client: httpx.Client, prompt: str, n_predict: int) -> tuple[float, float, dict]:
    """One streamed greedy /completion: (time to first token, decode tokens/s, the last event)."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    first = None
    last: dict = {}
    with client.stream("POST", "/completion", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"/completion failed: {event['error']}")
            if first is None and event.get("content"):
                first = time.perf_counter()
            last = event
    done = time.perf_counter()
    first = first or done
    n = last.get("tokens_predicted", 0)
    return first - sent, (n - 1) / (done - first) if n > 1 and done > first else 0.0, last


def measure(name: str, model: Path, ctx: int, threads: int, kv_type: str, prompt: str, n_predict: int,
            log_dir: Path) -> tuple[Side, int | None]:
    """One fresh server, one request: its Side and, for edgechat, the planner's estimate."""
    port = _free_port()
    proc = _start(commands(name, port, model, ctx, threads, kv_type), port, f"long-context-{name}", log_dir)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            estimate = unloaded = None
            if name == "edgechat":
                (entry,) = client.get("/api/ps").json()["models"]
                estimate = entry["size"]
                # the server without its model: what the process holds besides what the planner plans
                unload(str(client.base_url), entry["model"].removesuffix(":latest"))
                unloaded = proc_status(proc.pid)["VmRSS"]
            # one short answer first on both sides (edgechat's loads the model again)
            complete(client, "def main():", 1)
            loaded = proc_status(proc.pid)["VmRSS"]
            ttft, decode, last = complete(client, prompt, n_predict)
            status = proc_status(proc.pid)
    finally:
        _stop(proc)
    timings = last.get("timings", {})
    side = Side(name, kv_type, last.get("tokens_evaluated", 0), ttft, decode, last.get("tokens_predicted", 0),
                timings.get("prompt_per_second", 0.0), timings.get("predicted_per_second", 0.0),
                status["VmHWM"], status["RssAnon"], status["RssFile"], loaded, unloaded)
    return side, estimate


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the real Qwen2.5-Coder-0.5B, bench/realmodel.py)")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--prompt-tokens", type=int, default=16000)
    ap.add_argument("--gen", type=int, default=64, help="tokens generated at that depth")
    ap.add_argument("--kv-types", default="f16,q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    args = ap.parse_args(argv)

    model = args.model or real_model_path()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    # the prompt is cut with llama-server's tokenizer, on a small server of its own
    port = _free_port()
    proc = _start(commands("llama-server", port, model, 2048, 1, "f16"), port, "long-context-tokenizer", args.log_dir)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            prompt = source_file(client, args.prompt_tokens, PROMPT_SOURCES)
    finally:
        _stop(proc)

    sides: list[Side] = []
    estimates: dict[str, int] = {}
    for i, kv_type in enumerate(args.kv_types.split(",")):
        for name in SERVERS if i % 2 == 0 else reversed(SERVERS):
            side, estimate = measure(name, model, args.ctx, args.threads, kv_type, prompt, args.gen, args.log_dir)
            sides.append(side)
            if estimate is not None:
                estimates[kv_type] = estimate
            print(f"{kv_type} {name}: TTFT {side.ttft_s:.1f} s, decode {side.decode_tps:.2f} t/s, VmHWM {_mib(side.vm_hwm)}",
                  file=sys.stderr)

    report = []
    for kv_type, estimate in estimates.items():
        ours, ref = (next(s for s in sides if s.kv_type == kv_type and s.server == name) for name in SERVERS)
        report.append({
            "kv_type": kv_type,
            "estimate": estimate,
            "ttft_ratio": ours.ttft_s / ref.ttft_s,
            "decode_ratio": ours.decode_tps / ref.decode_tps if ref.decode_tps else 0.0,
            "rss_over_estimate": ours.vm_hwm / estimate,
            # the model's share: the peak less the same server with its model unloaded
            "model_rss_over_estimate": (ours.vm_hwm - (ours.rss_unloaded or 0)) / estimate,
            "llama_server_rss_over_estimate": ref.vm_hwm / estimate,
        })
    if args.json:
        print(json.dumps({"model": str(model), "ctx": args.ctx, "threads": args.threads, "sides": [asdict(s) for s in sides],
                          "report": report}, indent=2))
        return 0
    print(f"{model.name}, ctx {args.ctx}, {args.threads} threads, flash attention on, prompt cache off")
    print(f"{'kv':<6} {'server':<13} {'prompt':>7} {'TTFT s':>8} {'decode t/s':>11} {'srv pp t/s':>11} {'srv tg t/s':>11} "
          f"{'VmHWM':>10} {'anon':>10} {'file':>10}")
    for s in sides:
        print(f"{s.kv_type:<6} {s.server:<13} {s.prompt_tokens:>7} {s.ttft_s:>8.1f} {s.decode_tps:>11.2f} {s.server_prefill_tps:>11.1f} "
              f"{s.server_decode_tps:>11.2f} {_mib(s.vm_hwm):>10} {_mib(s.rss_anon):>10} {_mib(s.rss_file):>10}")
    for r in report:
        print(f"{r['kv_type']}: TTFT {r['ttft_ratio']:.2f}x llama-server's (target <= 1.0), decode {r['decode_ratio']:.2f}x (>= 1.0); "
              f"peak RSS {r['rss_over_estimate']:.3f}x the planner's {_mib(r['estimate'])}, less the server without its model "
              f"{r['model_rss_over_estimate']:.3f}x (0.95-1.05); llama-server's peak {r['llama_server_rss_over_estimate']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
