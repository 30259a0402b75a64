"""`edgechat serve`'s /v1/embeddings against `llama-server --embeddings --pooling mean`, same file, same run.

256 inputs of 10-200 tokens (words drawn with a fixed seed), sent in requests of 32 inputs one
after another; inputs/s and tokens/s for each side, the ratio (target >= 1.0x), and how close
the two servers' vectors are (cosine per input: the same pooling gives ~1). SmolLM2's GGUF names
no pooling, so both are told mean. Each round starts both servers afresh and alternates which
goes first (see bench/README.md: one process draws one of two speeds for its whole life).

    python -m bench.bench_embeddings [--rounds 2] [--inputs 256] [--batch 32] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from bench.bench_serve import _free_port, _server
from bench.llamabench import find_llama_server
from edgechat.config import get_paths
from edgechat.models import resolve_model
from quantize.llm import use_extra_buffers

MODEL = "smollm2-135m-instruct"
THREADS = 2
WORDS = ("river stone market light quiet engine garden winter paper signal morning copper valley "
         "window travel silver forest number yellow basket harbor planet coffee ladder pocket orange").split()


def make_inputs(n: int, seed: int) -> list[str]:
    """n texts of 10-200 tokens (SmolLM2 gives these words one token each, a space included)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 200))) for _ in range(n)]


def run_side(url: str, inputs: list[str], batch: int) -> tuple[float, int, np.ndarray]:
    """Seconds for all inputs in requests of `batch`, prompt tokens as the server counted them, the vectors."""
    vectors, tokens = [], 0
    with httpx.Client(timeout=600) as client:
        client.post(f"{url}/v1/embeddings", json={"input": inputs[:2]}).raise_for_status()  # first-use setup off the clock
        start = time.perf_counter()
        for i in range(0, len(inputs), batch):
            r = client.post(f"{url}/v1/embeddings", json={"input": inputs[i : i + batch], "encoding_format": "float"})
            r.raise_for_status()
            body = r.json()
            tokens += body["usage"]["prompt_tokens"]
            vectors += [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
        return time.perf_counter() - start, tokens, np.array(vectors)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    args = ap.parse_args(argv)

    model_path = resolve_model(MODEL, get_paths())
    inputs = make_inputs(args.inputs, args.seed)
    seconds: dict[str, list[float]] = {"llama-server": [], "edgechat": []}
    tokens, cosines = 0, []
    for rnd in range(args.rounds):
        llama_port, edge_port = _free_port(), _free_port()
        llama_cmd = [
            str(find_llama_server()), "-m", str(model_path), "-t", str(THREADS), "-tb", str(THREADS),
            "--embeddings", "--pooling", "mean", "-np", str(args.batch), "-c", str(args.batch * 512), "--kv-unified",
            "--no-webui", "--host", "127.0.0.1", "--port", str(llama_port),
            # the engine keeps weights in plain buffers on AMX CPUs: the reference lays them out alike
            *([] if use_extra_buffers() else ["--no-repack"]),
        ]
        edge_cmd = [sys.executable, "-m", "edgechat", "serve", "-m", MODEL, "--threads", str(THREADS), "--ctx", "512",
                    "--parallel", "1", "--port", str(edge_port), "--degrade-queue-wait", "0"]
        with contextlib.ExitStack() as stack:
            urls = {
                "llama-server": stack.enter_context(_server(llama_cmd, llama_port, "llama-server-embeddings", args.log_dir)),
                "edgechat": stack.enter_context(_server(edge_cmd, edge_port, "edgechat-embeddings", args.log_dir)),
            }
            results = {}
            for name in list(urls) if rnd % 2 == 0 else list(reversed(urls)):
                results[name] = run_side(urls[name], inputs, args.batch)
                seconds[name].append(results[name][0])
                print(f"round {rnd + 1}/{args.rounds} {name}: {len(inputs) / results[name][0]:.1f} inputs/s", file=sys.stderr)
        tokens = results["edgechat"][1]
        ref_tokens = results["llama-server"][1]
        ours, ref = results["edgechat"][2], results["llama-server"][2]
        cosines = np.sum(ours * ref, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))

    best = {name: min(s) for name, s in seconds.items()}  # each side's best round: the least disturbed
    report = {
        name: {"inputs_s": len(inputs) / t, "tokens_s": tokens / t, "seconds": seconds[name]} for name, t in best.items()
    }
    report["ratio"] = best["llama-server"] / best["edgechat"]
    report["tokens"] = {"edgechat": tokens, "llama-server": ref_tokens}
    report["cosine"] = {"min": float(cosines.min()), "mean": float(cosines.mean())}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{len(inputs)} inputs ({tokens} tokens by edgechat's count, {ref_tokens} by llama-server's) in requests of {args.batch}, {THREADS} threads")
    for name in ("llama-server", "edgechat"):
        r = report[name]
        print(f"  {name:<13} {r['inputs_s']:7.1f} inputs/s {r['tokens_s']:8.0f} tokens/s  (rounds: {', '.join(f'{s:.2f} s' for s in r['seconds'])})")
    print(f"  edgechat / llama-server: {report['ratio']:.2f}x (target >= 1.0x)")
    print(f"  cosine between the two servers' vectors: min {report['cosine']['min']:.6f}, mean {report['cosine']['mean']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
