"""The ONNX path against its references, in the same run, on one embedded model's HF checkpoint.

Export: `edgechat quantize --format onnx` (int4) against onnxruntime-genai's model builder
(`-p int4 -e cpu`, which imports torch and transformers), each in its own process: wall time and
peak RSS. Speed: prefill and decode tokens/s of edgechat's onnxruntime engine on our folder,
onnxruntime-genai on the same folder, and edgechat's llama.cpp engine on a Q4_K_M of the same
checkpoint; folder and file sizes side by side. Each runtime gets the same prompt and greedy
decoding of a fixed number of tokens, `--rounds` times in turn; the best round counts.

    python bench/bench_onnx.py [--model gemma3-270m] [--threads 2] [--rounds 3] [--no-export]

Goals (issue 12): export <= 0.5x time and <= 0.3x RSS of the builder; our decode and prefill
>= 0.95x onnxruntime-genai's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_quantize import measure  # noqa: E402  (after the path is set)

PROMPT = ("The lighthouse keeper wrote in his log every evening, even when nothing had happened. On calm nights he "
          "noted the wind, the colour of the sea and the ships that passed far out on the horizon. ") * 8


def size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    return sum(p.stat().st_size for p in files) / 1e6


def ours(folder: Path, prompt: list[int], n: int, threads: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of an edgechat engine on `folder` (ONNX) or a GGUF."""
    from edgechat.engine import ChatRequest, EngineConfig, SamplingParams, open_engine

    with open_engine(EngineConfig(model=str(folder), n_ctx=2048, n_threads=threads, speculative="off")) as engine:
        text = engine.detokenize(prompt)
        request = ChatRequest(prompt=text, sampling=SamplingParams(temperature=0), max_tokens=n, ignore_eos=True)
        engine.submit(ChatRequest(prompt="Hello", max_tokens=2)).result()  # warm up
        m = engine.submit(request).result().metrics
    return m.prefill_tps, m.decode_tps


def genai(folder: Path, prompt: list[int], n: int, threads: int) -> tuple[float, float]:
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.clear_providers()
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + n + 1)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    generator.generate_next_token()
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n - 1):
        generator.generate_next_token()
    decode = time.perf_counter() - start
    return len(prompt) / prefill, (n - 1) / decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="embedded model whose HF checkpoint to use")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per round")
    ap.add_argument("--no-export", action="store_true", help="skip the builder comparison (export ours only)")
    args = ap.parse_args()
    from tests.hf_fixtures import hf_checkpoint

    checkpoint = hf_checkpoint(args.model)
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as tmp:
        tmp = Path(tmp)
        ours_dir, theirs_dir, gguf = tmp / "ours", tmp / "builder", tmp / "model-Q4_K_M.gguf"
        print(f"{args.model}, {args.threads} threads (a shared machine: compare ratios, not absolutes)")
        t_ours, rss_ours = measure("edgechat quantize --format onnx (int4)",
                                   [py, "-m", "edgechat", "quantize", str(checkpoint), "--format", "onnx", "--no-report",
                                    "-o", str(ours_dir), "--threads", str(args.threads)])
        built = False
        if not args.no_export:
            try:
                t_them, rss_them = measure("onnxruntime-genai builder (int4, cpu)",
                                           [py, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o",
                                            str(theirs_dir), "-p", "int4", "-e", "cpu", "-c", str(tmp / "hf-cache")])
                print(f"export: time {t_ours / t_them:.2f}x, peak RSS {rss_ours / rss_them:.2f}x of the builder")
                built = True
            except SystemExit as exc:  # its 0.18 release cannot read transformers 5's Gemma 3 config
                print(f"onnxruntime-genai builder failed: {str(exc).strip().splitlines()[-1]}")
        measure("edgechat quantize (GGUF Q4_K_M)", [py, "-m", "edgechat", "quantize", str(checkpoint), "--no-report",
                                                   "-o", str(gguf), "--threads", str(args.threads)])
        sizes = [("ours (ONNX int4)", size_mb(ours_dir)), ("GGUF Q4_K_M", size_mb(gguf))]
        if built:
            sizes.insert(1, ("builder (ONNX int4)", size_mb(theirs_dir)))
        print("size: " + ", ".join(f"{name} {mb:.1f} MB" for name, mb in sizes))

        from edgechat.engine.runners.vocab import Vocabulary

        vocab = Vocabulary(ours_dir / "tokenizer.gguf")
        prompt = vocab.tokenize(PROMPT, add_bos=vocab.add_bos, special=False)
        vocab.close()
        runs = {
            "edgechat onnxruntime engine": lambda: ours(ours_dir, prompt, args.tokens, args.threads),
            "onnxruntime-genai, same folder": lambda: genai(ours_dir, prompt, args.tokens, args.threads),
            "edgechat llama.cpp engine, Q4_K_M": lambda: ours(gguf, prompt, args.tokens, args.threads),
        }
        best = {name: (0.0, 0.0) for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                pp, tg = run()
                best[name] = (max(best[name][0], pp), max(best[name][1], tg))
        print(f"{len(prompt)}-token prompt, {args.tokens} tokens decoded, best of {args.rounds} rounds")
        ref_pp, ref_tg = best["onnxruntime-genai, same folder"]
        for name, (pp, tg) in best.items():
            print(f"{name:<36} prefill {pp:8.1f} t/s ({pp / ref_pp:.2f}x)  decode {tg:6.1f} t/s ({tg / ref_tg:.2f}x)")


if __name__ == "__main__":
    main()
