"""Images in the engine (issue 30): the encode time of one picture, a follow-up turn's time to first
token with the picture's cells reused against the same turn sent cold (another session, so the
picture is encoded and decoded again), and text-only decoding with the projector loaded against
the same model without it (target >= 0.98x).

No vision model ships as a package: the projector is the tests' tiny random one for the embedded
SmolLM2 (tests/tiny_mmproj.py: a 32-pixel ViT, 16 image cells), so the encode figure says what
the path costs around libmtmd, not what SigLIP costs on a phone; pass `--mmproj FILE --model M`
for a real pair. Both engines stay loaded; decode samples alternate between them (the first
side changing each round).

    python -m bench.bench_vision [--rounds 3] [--model M --mmproj FILE] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from edgechat.config import get_paths
from edgechat.engine import ChatRequest, Engine, EngineConfig, ImageInput, SamplingParams
from edgechat.models import resolve_model

GREEDY = SamplingParams(temperature=0)
#: decode samples per engine per round, each 96 tokens
DECODE_SAMPLES = 3
QUESTION = "What is in this picture?"


# the tests' projector writer and PNG writer (tests/tiny_mmproj.py)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_mmproj import png, text_embedding_width, write_tiny_mmproj  # noqa: E402


def _tiny_pair(model: str | None, mmproj: str | None, workdir: Path) -> tuple[Path, Path]:
    path = resolve_model(model, get_paths())
    if mmproj:
        return path, Path(mmproj)
    return path, write_tiny_mmproj(workdir / "tiny-mmproj.gguf", text_embedding_width(path))


def _picture() -> bytes:
    return png(224, 224, lambda x, y: (x, y, (x * y) % 256))


def _ask(engine: Engine, messages: list[dict], session: str, n: int = 8):
    done = engine.submit(ChatRequest(messages=messages, sampling=GREEDY, max_tokens=n, session=session)).result(600)
    assert done.error is None, done.error
    return done


def vision_round(engine: Engine, picture: bytes, k: int) -> dict:
    first = [{"role": "user", "content": [ImageInput(picture), QUESTION]}]
    encodes = engine.projector.encodes
    done = _ask(engine, first, f"warm{k}")
    follow = first + [{"role": "assistant", "content": done.text}, {"role": "user", "content": "Say more about it."}]
    reused = _ask(engine, follow, f"warm{k}")
    assert engine.projector.encodes == encodes + 1, "the follow-up encoded the picture again"
    cold = _ask(engine, follow, f"cold{k}")
    return {"followup_ttft_reused": reused.metrics.ttft, "followup_ttft_cold": cold.metrics.ttft}


def encode_seconds(engine: Engine, picture: bytes) -> float:
    chunks = engine.projector.chunks(engine.projector.marker, [engine.projector.image(picture)], add_special=False)
    chunk = next(c for c in chunks if not isinstance(c, list))
    started = time.perf_counter()
    engine.projector.encode(chunk)
    return time.perf_counter() - started


def decode_tps(engine: Engine) -> float:
    done = engine.submit(ChatRequest(messages=[{"role": "user", "content": "Write a long story about the sea."}],
                                     sampling=GREEDY, max_tokens=96, ignore_eos=True, speculative="off")).result(600)
    return done.metrics.decode_tps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model")
    ap.add_argument("--mmproj")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model, mmproj = _tiny_pair(args.model, args.mmproj, Path(tmp))
        picture = _picture()
        # its own data folder: the sessions' snapshots must not come from (or go to) the user's
        base = {"model": str(model), "n_ctx": 2048, "n_threads": args.threads, "paths": get_paths(Path(tmp) / "data")}
        encodes, rounds, with_proj, without = [], [], [], []
        # both engines loaded at once and sampled in alternation, many short runs each: this
        # machine's speed drifts over seconds, and a round per engine load let it decide the ratio
        with Engine(EngineConfig(**base, mmproj=str(mmproj))) as vision, Engine(EngineConfig(**base)) as plain:
            decode_tps(vision), decode_tps(plain)  # warm-up
            for k in range(args.rounds):
                encodes.append(encode_seconds(vision, picture))
                rounds.append(vision_round(vision, picture, k))
                for _ in range(DECODE_SAMPLES):
                    for has in ((True, False) if k % 2 == 0 else (False, True)):
                        (with_proj if has else without).append(decode_tps(vision if has else plain))
    result = {
        "encode_s": statistics.median(encodes),
        "followup_ttft_reused_s": statistics.median(r["followup_ttft_reused"] for r in rounds),
        "followup_ttft_cold_s": statistics.median(r["followup_ttft_cold"] for r in rounds),
        "decode_tps_with_projector": statistics.median(with_proj),
        "decode_tps_without": statistics.median(without),
        "decode_samples": len(with_proj),
    }
    result["followup_reuse_ratio"] = result["followup_ttft_reused_s"] / result["followup_ttft_cold_s"]
    result["text_decode_ratio"] = result["decode_tps_with_projector"] / result["decode_tps_without"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"encode one picture: {result['encode_s'] * 1000:.1f} ms")
        print(f"follow-up TTFT reused {result['followup_ttft_reused_s'] * 1000:.0f} ms vs cold "
              f"{result['followup_ttft_cold_s'] * 1000:.0f} ms ({result['followup_reuse_ratio']:.2f}x)")
        print(f"text decode with projector {result['decode_tps_with_projector']:.1f} vs without "
              f"{result['decode_tps_without']:.1f} t/s ({result['text_decode_ratio']:.3f}x, target >= 0.98; "
              f"medians of {len(with_proj)} alternating samples each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
