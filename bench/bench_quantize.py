"""edgechat quantize against llama.cpp's official pipeline, in the same run, on Gemma 3 270M.

Official: convert_hf_to_gguf.py (needs torch) to F16, then llama_model_quantize to Q4_K_M.
Ours: one `quantize.convert` call, checkpoint to Q4_K_M. Each step runs in its own process so
its wall time and peak RSS are its own. Then: are the tensor types the same, are the tensors
byte-identical, and the mean KLD of each Q4_K_M against the official F16.

    python bench/bench_quantize.py [--model gemma3-270m] [--llama-cpp DIR] [--threads N] [--no-quality] [--imatrix]

Goals (issue 5): time <= 0.6x, peak RSS <= 0.35x, same types, KLD no worse.

--imatrix (issue 15): the importance-matrix pipelines on the built-in calibration text instead.
Official: convert_hf_to_gguf.py -> llama-imatrix (-c 512) -> llama-quantize --imatrix Q4_K_M
(bench/build_llama_bench.sh builds both tools). Ours: one process, checkpoint -> F16 -> imatrix
-> Q4_K_M, as `edgechat quantize --imatrix` runs. Quality on held-out text (the report's text,
not in the calibration text): KLD and top-1 vs the official F16, for ours with and without the
imatrix and for the official imatrix Q4_K_M. Goals: time <= 0.6x, RSS <= 0.35x, KLD no worse
than llama.cpp's and lower than without an imatrix.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_LLAMA_CPP = Path.home() / ".cache/edgechat-bench/llama.cpp-0.3.36/work/llama_cpp_python-0.3.36/vendor/llama.cpp"

_QUANTIZE_WITH_LLAMA_CPP = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = int(sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""

_QUANTIZE_WITH_EDGECHAT = """
import sys
from quantize import convert
convert(sys.argv[1], sys.argv[2], type_name="Q4_K_M", threads=int(sys.argv[3]))
"""


_IMATRIX_WITH_EDGECHAT = """
import sys, tempfile
from pathlib import Path
from quantize import convert
from quantize.calibrate import builtin_text, compute
with tempfile.TemporaryDirectory(dir=Path(sys.argv[2]).parent) as tmp:
    f16 = convert(sys.argv[1], Path(tmp) / "f16.gguf", type_name="F16", threads=int(sys.argv[3])).path
    matrix = compute(f16, builtin_text(), threads=int(sys.argv[3]))
convert(sys.argv[1], sys.argv[2], type_name="Q4_K_M", threads=int(sys.argv[3]), imatrix=matrix)
"""


def measure(label: str, argv: list[str], env: dict | None = None) -> tuple[float, float]:
    """Run argv; return (wall seconds, peak RSS in MB) of that process alone."""
    start = time.perf_counter()
    # stderr to a file, not a pipe: a chatty tool (progress bars) would block on a full pipe
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{label} failed:\n{stderr[-3000:]}")
    rss = usage.ru_maxrss / 1024  # KB on Linux
    print(f"{label:<44} {wall:7.1f} s  {rss:7.0f} MB peak RSS", flush=True)
    return wall, rss


def tensor_map(path: Path) -> dict:
    import gguf

    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="embedded model whose HF checkpoint to convert")
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP, help="llama.cpp source tree (converter)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-quality", action="store_true", help="skip the KLD comparison (two model runs)")
    ap.add_argument("--imatrix", action="store_true", help="compare the importance-matrix pipelines (issue 15)")
    args = ap.parse_args()

    from tests.hf_fixtures import hf_checkpoint

    checkpoint = hf_checkpoint(args.model)
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    if not converter.is_file():
        sys.exit(f"no {converter}; pass --llama-cpp DIR")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    threads = str(args.threads)
    print(f"{args.model}: {checkpoint} ({sum(f.stat().st_size for f in checkpoint.glob('*.safetensors')) / 1e6:.0f} MB "
          f"safetensors), {threads} threads", flush=True)

    if args.imatrix:
        bench_imatrix(checkpoint, converter, env, threads, args.no_quality)
        return
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        tmp = Path(tmp)
        off_f16, off_q4, ours_q4 = tmp / "official-F16.gguf", tmp / "official-Q4_K_M.gguf", tmp / "ours-Q4_K_M.gguf"
        t_conv, rss_conv = measure("official: convert_hf_to_gguf.py --outtype f16",
                                   [sys.executable, str(converter), str(checkpoint), "--outtype", "f16",
                                    "--outfile", str(off_f16)], env)
        t_q, rss_q = measure("official: llama_model_quantize Q4_K_M",
                             [sys.executable, "-c", _QUANTIZE_WITH_LLAMA_CPP, str(off_f16), str(off_q4), threads], env)
        t_ours, rss_ours = measure("edgechat quantize (checkpoint -> Q4_K_M)",
                                   [sys.executable, "-c", _QUANTIZE_WITH_EDGECHAT, str(checkpoint), str(ours_q4), threads], env)
        t_official, rss_official = t_conv + t_q, max(rss_conv, rss_q)
        print(f"\ntime ratio     {t_ours / t_official:.2f}x  ({t_ours:.1f} s vs {t_official:.1f} s; goal <= 0.6x)")
        print(f"peak RSS ratio {rss_ours / rss_official:.2f}x  ({rss_ours:.0f} MB vs {rss_official:.0f} MB; goal <= 0.35x)")

        ours, official = tensor_map(ours_q4), tensor_map(off_q4)
        same_types = {n: t.tensor_type for n, t in ours.items()} == {n: t.tensor_type for n, t in official.items()}
        identical = same_types and all(
            bytes(t.data.view("uint8")) == bytes(official[n].data.view("uint8")) for n, t in ours.items()
        )
        print(f"same tensor types: {same_types}; byte-identical tensors: {identical} ({len(ours)} tensors)")

        if not args.no_quality:
            from quantize.report import compare

            q_ours = compare(ours_q4, off_f16, threads=args.threads)
            q_official = compare(off_q4, off_f16, threads=args.threads)
            print(f"mean KLD vs official F16: ours {q_ours.mean_kld:.5f}, official {q_official.mean_kld:.5f}; "
                  f"top-1 {100 * q_ours.top1_agreement:.1f}% vs {100 * q_official.top1_agreement:.1f}%")


def bench_imatrix(checkpoint: Path, converter: Path, env: dict, threads: str, no_quality: bool) -> None:
    root = Path(__file__).resolve().parents[1]
    built = subprocess.run(["bash", str(root / "bench/build_llama_bench.sh"), "llama-imatrix", "llama-quantize"],
                           check=True, capture_output=True, text=True)
    tools = Path(built.stdout.strip().splitlines()[-1]).parent
    calibration = root / "quantize" / "calibration.txt"
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        tmp = Path(tmp)
        off_f16, off_imatrix, off_q4 = tmp / "official-F16.gguf", tmp / "official.imatrix.gguf", tmp / "official-Q4_K_M.gguf"
        ours_q4, plain_q4 = tmp / "ours-imatrix-Q4_K_M.gguf", tmp / "ours-Q4_K_M.gguf"
        t_conv, rss_conv = measure("official: convert_hf_to_gguf.py --outtype f16",
                                   [sys.executable, str(converter), str(checkpoint), "--outtype", "f16",
                                    "--outfile", str(off_f16)], env)
        t_im, rss_im = measure("official: llama-imatrix -c 512",
                               [str(tools / "llama-imatrix"), "-m", str(off_f16), "-f", str(calibration), "-o",
                                str(off_imatrix), "-c", "512", "-t", threads, "--no-ppl"])
        t_q, rss_q = measure("official: llama-quantize --imatrix Q4_K_M",
                             [str(tools / "llama-quantize"), "--imatrix", str(off_imatrix), str(off_f16), str(off_q4),
                              "Q4_K_M", threads])
        t_ours, rss_ours = measure("edgechat (checkpoint -> F16 -> imatrix -> Q4_K_M)",
                                   [sys.executable, "-c", _IMATRIX_WITH_EDGECHAT, str(checkpoint), str(ours_q4), threads], env)
        measure("edgechat without imatrix (checkpoint -> Q4_K_M)",
                [sys.executable, "-c", _QUANTIZE_WITH_EDGECHAT, str(checkpoint), str(plain_q4), threads], env)
        t_official, rss_official = t_conv + t_im + t_q, max(rss_conv, rss_im, rss_q)
        print(f"\ntime ratio     {t_ours / t_official:.2f}x  ({t_ours:.1f} s vs {t_official:.1f} s; goal <= 0.6x)")
        print(f"peak RSS ratio {rss_ours / rss_official:.2f}x  ({rss_ours:.0f} MB vs {rss_official:.0f} MB; goal <= 0.35x)")
        if no_quality:
            return
        from quantize.report import compare

        for label, path in (("ours, imatrix", ours_q4), ("ours, no imatrix", plain_q4), ("llama.cpp, imatrix", off_q4)):
            q = compare(path, off_f16, threads=int(threads))
            print(f"held-out text vs official F16, {label:<20} KLD {q.mean_kld:.5f}  top-1 {100 * q.top1_agreement:.1f}%",
                  flush=True)


if __name__ == "__main__":
    main()
