"""llama.cpp's own llama-bench as the reference the engine benchmark is measured against.

The binaries come from bench/build_llama_bench.sh, built from the llama.cpp sources vendored in
the pinned llama-cpp-python sdist, so both sides run the same ggml code.

    python -m bench.llamabench [MODEL_PATH ...]   # default: both embedded models, 2 threads
"""

from __future__ import annotations

import argparse
import errno
import json
import subprocess
import sys
from pathlib import Path

from quantize.llm import use_extra_buffers

BUILD_SCRIPT = Path(__file__).resolve().with_name("build_llama_bench.sh")
ALL_TOOLS = ("llama-bench", "llama-server", "llama-quantize", "llama-imatrix")


def llama_tools_dir(*tools: str, build: bool = True, timeout: float | None = None, log=None) -> Path:
    """The folder holding llama.cpp's `tools` (default: llama-bench, llama-server, llama-quantize,
    llama-imatrix), building any the cache lacks first (about 10 minutes on 2 cores, once per
    machine and pinned version). With build=False, raises FileNotFoundError instead of building.
    The build's output goes to `log` (a file object; default: this process's stderr)."""
    tools = tools or ALL_TOOLS
    # The script alone knows the pinned version and cache layout; when the binaries exist it only
    # prints the path, so calling it every time costs milliseconds.
    cmd = ["bash", str(BUILD_SCRIPT), *([] if build else ["--check"]), *tools]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 1 and not build and lines:
        folder = Path(lines[-1]).parent
        raise FileNotFoundError(errno.ENOENT, f"{', '.join(tools)} not all built", str(folder))
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{BUILD_SCRIPT.name} {' '.join(tools)} failed (exit {proc.returncode})")
    folder = Path(lines[-1]).parent
    missing = [t for t in tools if not (folder / t).is_file()]
    if missing:
        raise RuntimeError(f"{BUILD_SCRIPT.name} reported {folder}, which lacks {', '.join(missing)}")
    return folder


def ensure_llama_bench() -> Path:
    """Path of llama-bench, building the tools first if the cache lacks them."""
    return llama_tools_dir() / "llama-bench"


def find_llama_server() -> Path:
    """Path of llama-server, building it first if the cache lacks it."""
    return llama_tools_dir("llama-server") / "llama-server"


def run_llama_bench(
    model_path: str | Path,
    threads: int = 2,
    n_prompt: int = 512,
    n_gen: int = 128,
    repetitions: int = 3,
    n_depth: int = 0,
    flash_attn: str = "auto",
) -> dict:
    """Run llama-bench with its defaults otherwise; tokens/s averaged over the repetitions.
    n_depth tokens are in the KV cache before each test; flash_attn is auto, on or off.

    Returns {"pp_tps": prefill t/s, "tg_tps": decode t/s, "raw": llama-bench's JSON records}.
    pp_tps (tg_tps) is None when n_prompt (n_gen) is 0, since llama-bench then skips that test.
    """
    cmd = [
        str(ensure_llama_bench()),
        "-m", str(model_path),
        "-t", str(threads),
        "-p", str(n_prompt),
        "-n", str(n_gen),
        "-r", str(repetitions),
        "-d", str(n_depth),
        "-fa", flash_attn,
        # the engine's weight layout: without llama.cpp's extra buffer types where it keeps them
        # off (AMX CPUs, where ggml's AMX matmul faults in some virtual machines)
        *([] if use_extra_buffers() else ["--repack", "0"]),
        "-o", "json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"llama-bench failed (exit {proc.returncode}) on {model_path}:\n{tail}")
    records = json.loads(proc.stdout)
    # pp and tg are separate tests: a prompt-only record and a generation-only record.
    pp = [r["avg_ts"] for r in records if r["n_prompt"] > 0 and r["n_gen"] == 0]
    tg = [r["avg_ts"] for r in records if r["n_gen"] > 0 and r["n_prompt"] == 0]
    return {
        "pp_tps": pp[0] if pp else None,
        "tg_tps": tg[0] if tg else None,
        "raw": records,
    }


def _embedded_models() -> list[Path]:
    from edgechat.config import get_paths
    from edgechat.models import resolve_model

    paths = get_paths()
    return [resolve_model(name, paths) for name in ("smollm2-135m-instruct", "gemma3-270m")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llamabench", description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", type=Path, help="GGUF files (default: the embedded models)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    args = parser.parse_args(argv)
    for model in args.models or _embedded_models():
        res = run_llama_bench(model, threads=args.threads, repetitions=args.repetitions)
        print(f"{model.name}: pp512 {res['pp_tps']:.1f} t/s, tg128 {res['tg_tps']:.1f} t/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
