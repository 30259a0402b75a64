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
-> Q4_K_M, as `edgechat quantize --imatrix` runs. The llama.cpp tools read our F16: its tensors
are byte-identical to convert_hf_to_gguf's (checked here), but the test checkpoint's
tokenizer_config.json lacks the Hub repo's added_tokens_decoder, so convert_hf_to_gguf types
Gemma's whitespace pieces NORMAL where the tokenizer.model says USER_DEFINED, and its GGUF
tokenizes text unlike transformers (3143 calibration tokens against 2942): on its F16 the two
imatrices would not be made from the same tokens. llama-imatrix runs with its default batch (4
chunks at once), which on SmolLM2 moves its own sums by ~1e-3 from its one-chunk (-b 512) run and
drops 6 tokens from attn_output's counts; against the one-chunk run ours agree to ~1e-6 (measured).
Quality on held-out text (the report's text,
then docs/ARCHITECTURE.md; none of it in the calibration text), --held-out-chunks chunks of 512
tokens: KLD and top-1 vs our F16, for ours with and without the imatrix and for llama.cpp's
imatrix Q4_K_M. Goals: time <= 0.6x, RSS <= 0.35x, KLD no worse than llama.cpp's and lower than
without an imatrix.
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
import sys
from quantize import convert
from quantize.calibrate import builtin_text, compute
from quantize.imatrix import write
f16 = convert(sys.argv[1], sys.argv[3], type_name="F16", threads=int(sys.argv[4])).path
matrix = compute(f16, builtin_text(), threads=int(sys.argv[4]))
write(matrix, sys.argv[5])
convert(sys.argv[1], sys.argv[2], type_name="Q4_K_M", threads=int(sys.argv[4]), imatrix=matrix)
"""


def measure(label: str, argv: list[str], env: dict | None = None) -> tuple[float, float]:
    """Run argv; return (wall seconds, peak RSS in MB) of that process alone."""
    return measure_cpu(label, argv, env)[:2]


def measure_cpu(label: str, argv: list[str], env: dict | None = None) -> tuple[float, float, float]:
    """measure(), plus the CPU seconds (user + system) of the process: on a shared machine wall time
    follows the others' load, CPU time much less (with --threads 1 no thread spins at a barrier)."""
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
    cpu = usage.ru_utime + usage.ru_stime
    print(f"{label:<50} {wall:7.1f} s  {cpu:7.1f} s CPU  {rss:7.0f} MB peak RSS", flush=True)
    return wall, rss, cpu


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
    ap.add_argument("--held-out-chunks", type=int, default=4, help="--imatrix: 512-token chunks of held-out text")
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
        bench_imatrix(checkpoint, converter, env, threads, args.no_quality, args.held_out_chunks)
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


def bench_imatrix(checkpoint: Path, converter: Path, env: dict, threads: str, no_quality: bool,
                  held_out_chunks: int) -> None:
    import numpy as np

    from quantize.imatrix import read

    root = Path(__file__).resolve().parents[1]
    built = subprocess.run(["bash", str(root / "bench/build_llama_bench.sh"), "llama-imatrix", "llama-quantize"],
                           check=True, capture_output=True, text=True)
    tools = Path(built.stdout.strip().splitlines()[-1]).parent
    calibration = root / "quantize" / "calibration.txt"
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        tmp = Path(tmp)
        off_f16, off_imatrix, off_q4 = tmp / "official-F16.gguf", tmp / "official.imatrix.gguf", tmp / "official-Q4_K_M.gguf"
        f16, ours_q4, plain_q4 = tmp / "ours-F16.gguf", tmp / "ours-imatrix-Q4_K_M.gguf", tmp / "ours-Q4_K_M.gguf"
        ours_imatrix = tmp / "ours.imatrix.gguf"
        t_conv, rss_conv, c_conv = measure_cpu("official: convert_hf_to_gguf.py --outtype f16",
                                               [sys.executable, str(converter), str(checkpoint), "--outtype", "f16",
                                                "--outfile", str(off_f16)], env)
        t_ours, rss_ours, c_ours = measure_cpu("edgechat (checkpoint -> F16 -> imatrix -> Q4_K_M)",
                                               [sys.executable, "-c", _IMATRIX_WITH_EDGECHAT, str(checkpoint), str(ours_q4),
                                                str(f16), threads, str(ours_imatrix)], env)
        t_im, rss_im, c_im = measure_cpu("official: llama-imatrix -c 512",
                                         [str(tools / "llama-imatrix"), "-m", str(f16), "-f", str(calibration), "-o",
                                          str(off_imatrix), "-c", "512", "-t", threads, "--no-ppl"])
        t_q, rss_q, c_q = measure_cpu("official: llama-quantize --imatrix Q4_K_M",
                                      [str(tools / "llama-quantize"), "--imatrix", str(off_imatrix), str(f16), str(off_q4),
                                       "Q4_K_M", threads])
        measure("edgechat without imatrix (checkpoint -> Q4_K_M)",
                [sys.executable, "-c", _QUANTIZE_WITH_EDGECHAT, str(checkpoint), str(plain_q4), threads], env)
        t_official, rss_official = t_conv + t_im + t_q, max(rss_conv, rss_im, rss_q)
        c_official = c_conv + c_im + c_q
        print(f"\ntime ratio     {t_ours / t_official:.2f}x  ({t_ours:.1f} s vs {t_official:.1f} s; goal <= 0.6x)")
        print(f"CPU time ratio {c_ours / c_official:.2f}x  ({c_ours:.1f} s vs {c_official:.1f} s)")
        print(f"peak RSS ratio {rss_ours / rss_official:.2f}x  ({rss_ours:.0f} MB vs {rss_official:.0f} MB; goal <= 0.35x)")
        mine, official = tensor_map(f16), tensor_map(off_f16)
        same = mine.keys() == official.keys() and all(
            bytes(t.data.view("uint8")) == bytes(official[n].data.view("uint8")) for n, t in mine.items())
        print(f"our F16 tensors byte-identical to convert_hf_to_gguf's: {same}")
        a, b = read(ours_imatrix), read(off_imatrix)
        same_counts = a.entries.keys() == b.entries.keys() and all(
            np.array_equal(a.entries[n][1], b.entries[n][1]) for n in a.entries)
        worst = max(float(np.max(np.abs(a.entries[n][0] - s) / np.maximum(np.abs(s), 1e-30)))
                    for n, (s, _) in b.entries.items() if n in a.entries)
        print(f"imatrix vs llama-imatrix's: {len(a.entries)} vs {len(b.entries)} tensors, same counts: {same_counts}, "
              f"largest relative difference in sums {worst:.1e}")
        if no_quality:
            return
        from quantize.report import SAMPLE_TEXT, compare

        held_out = SAMPLE_TEXT + "\n" + (root / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
        for label, path in (("ours, imatrix", ours_q4), ("ours, no imatrix", plain_q4), ("llama.cpp, imatrix", off_q4)):
            q = compare(path, f16, text=held_out, threads=int(threads), max_chunks=held_out_chunks)
            print(f"held-out text ({q.n_tokens} tokens) vs F16, {label:<20} KLD {q.mean_kld:.5f}  "
                  f"top-1 {100 * q.top1_agreement:.1f}%", flush=True)


if __name__ == "__main__":
    main()
