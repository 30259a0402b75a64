"""KV cache manager benchmarks (issue 3), ratios measured in the same run.

1. Multi-turn prefix reuse: in a 40-turn conversation (new-message length held equal, answers
   fixed at 24 tokens), TTFT at turn 40 against turn 2 (target <= 1.5x), each the median of
   three neighbouring turns (38-40, 2-4) because a single 80 ms TTFT swings 20% on a noisy
   machine; beside the TTFT of re-prefilling turn 40's whole history cold, which is what a
   cache-less chat pays; with llama.cpp's flash attention on (its CPU default) and off, and
   llama-bench's own pp25 at depth 100 and 1,900 as the kernel's reference ratio.
2. Reopening a ~2,000-token conversation from its snapshot against a cold re-prefill of it
   (target <= 0.05x), on both embedded models.
3. Gemma 3's small sliding-window cache (issue 14) against the full one: KV bytes at an 8k
   context, and the 40-turn chat's TTFT at turns 2 and 40 with each.

    python -m bench.bench_kvcache [--threads 2] [--json] [--only swa]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from bench.llamabench import run_llama_bench
from edgechat.config import get_paths
from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams
from edgechat.models import resolve_model

GREEDY = SamplingParams(temperature=0)
SYSTEM = {"role": "system", "content": "You are a concise assistant."}


def _turn(engine, history, text, session, max_tokens=24):
    history.append({"role": "user", "content": text})
    done = engine.submit(ChatRequest(messages=[SYSTEM] + history, sampling=GREEDY, max_tokens=max_tokens,
                                     ignore_eos=True, session=session)).result()
    history.append({"role": "assistant", "content": done.text})
    return done.metrics


def multi_turn(model: str, threads: int, flash_attn: str = "auto") -> dict:
    cfg = dict(model=model, n_ctx=8192, n_threads=threads, flash_attn=flash_attn)
    with tempfile.TemporaryDirectory() as tmp, Engine(EngineConfig(paths=get_paths(tmp), **cfg)) as engine:
        history: list[dict] = []
        ttft = []
        for i in range(40):
            m = _turn(engine, history, f"Question {i + 10}: name one animal that lives in water.", "bench")
            ttft.append(m.ttft)
        cold_request = ChatRequest(messages=[SYSTEM] + history[:-1], sampling=GREEDY, max_tokens=1)
        history_tokens = engine.count_tokens(cold_request)
    with tempfile.TemporaryDirectory() as tmp, Engine(EngineConfig(paths=get_paths(tmp), **cfg)) as engine:
        cold = engine.submit(cold_request).result().metrics.ttft
    # llama.cpp's own cost of a 25-token batch near the start and at turn 40's depth
    path = resolve_model(model, get_paths())
    ref = [run_llama_bench(path, threads, n_prompt=25, n_gen=0, repetitions=5, n_depth=d, flash_attn=flash_attn)["pp_tps"]
           for d in (100, history_tokens)]
    return {
        "model": model,
        "flash_attn": flash_attn,
        "ttft_turn2_ms": statistics.median(ttft[1:4]) * 1000,
        "ttft_turn40_ms": statistics.median(ttft[37:40]) * 1000,
        "turn40_over_turn2": statistics.median(ttft[37:40]) / statistics.median(ttft[1:4]),
        "history_tokens_turn40": history_tokens,
        "cold_reprefill_turn40_ms": cold * 1000,
        "llama_bench_pp25_deep_over_shallow": ref[0] / ref[1],
    }


def swa_caches(threads: int, model: str = "gemma3-270m") -> dict:
    out = {"model": model}
    for swa in ("full", "small"):
        with tempfile.TemporaryDirectory() as tmp, Engine(EngineConfig(model=model, n_ctx=8192, n_threads=threads,
                                                                     swa_cache=swa, paths=get_paths(tmp))) as engine:
            history: list[dict] = []
            ttft = [_turn(engine, history, f"Question {i + 10}: name one animal that lives in water.", "bench").ttft
                    for i in range(40)]
            out[swa] = {"kv_mib": engine.plan.kv_cache / 2**20, "ttft_turn2_ms": statistics.median(ttft[1:4]) * 1000,
                        "ttft_turn40_ms": statistics.median(ttft[37:40]) * 1000}
    out["kv_full_over_small"] = out["full"]["kv_mib"] / out["small"]["kv_mib"]
    out["ttft40_small_over_full"] = out["small"]["ttft_turn40_ms"] / out["full"]["ttft_turn40_ms"]
    return out


def reopen(model: str, threads: int) -> dict:
    filler = " ".join(f"Fact {i}: the river stones are smooth and grey." for i in range(160))
    with tempfile.TemporaryDirectory() as warm_dir, tempfile.TemporaryDirectory() as cold_dir:
        history: list[dict] = []
        with Engine(EngineConfig(model=model, n_ctx=4096, n_threads=threads, paths=get_paths(warm_dir))) as engine:
            _turn(engine, history, f"Remember these notes. {filler}", "long", max_tokens=8)
            tokens = engine.count_tokens(ChatRequest(messages=[SYSTEM] + history))
            t = time.perf_counter()
            engine.release_session("long")
            save_s = time.perf_counter() - t
        results = {}
        for label, root in (("restore", warm_dir), ("cold", cold_dir)):
            with Engine(EngineConfig(model=model, n_ctx=4096, n_threads=threads, paths=get_paths(root))) as engine:
                m = _turn(engine, list(history), "Thanks.", "long", max_tokens=1)
                results[label] = m
        snap = sum(p.stat().st_size for p in get_paths(warm_dir).snapshots.glob("*.kv"))
    return {
        "model": model,
        "conversation_tokens": tokens,
        "snapshot_mb": snap / 1e6,
        "save_ms": save_s * 1000,
        "restore_ttft_ms": results["restore"].ttft * 1000,
        "cold_ttft_ms": results["cold"].ttft * 1000,
        "restored_tokens": results["restore"].cached_tokens,
        "ratio": results["restore"].ttft / results["cold"].ttft,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", choices=["swa"], help="Run one section only.")
    args = ap.parse_args()
    swa = swa_caches(args.threads)
    if args.only == "swa":
        print(json.dumps(swa, indent=2) if args.json else _swa_line(swa))
        return
    # flash attention (llama.cpp's CPU default) is faster near the start, slower deep into a chat
    turns = [multi_turn(m, args.threads, fa) for m in ("smollm2-135m-instruct", "gemma3-270m") for fa in ("auto", "off")]
    reopened = [reopen(m, args.threads) for m in ("smollm2-135m-instruct", "gemma3-270m")]
    if args.json:
        print(json.dumps({"multi_turn": turns, "reopen": reopened, "swa": swa}, indent=2))
        return
    for t in turns:
        print(f"40-turn chat on {t['model']} (flash attention {t['flash_attn']}): TTFT turn 2 {t['ttft_turn2_ms']:.0f} ms, "
              f"turn 40 {t['ttft_turn40_ms']:.0f} ms -> {t['turn40_over_turn2']:.2f}x (target <= 1.5x); cold re-prefill "
              f"of turn 40's {t['history_tokens_turn40']} tokens: {t['cold_reprefill_turn40_ms']:.0f} ms; llama-bench pp25 at that "
              f"depth vs depth 100: {t['llama_bench_pp25_deep_over_shallow']:.2f}x")
    for r in reopened:
        print(f"reopen {r['model']}: {r['conversation_tokens']} tokens, snapshot {r['snapshot_mb']:.1f} MB saved in "
              f"{r['save_ms']:.0f} ms; TTFT restored {r['restore_ttft_ms']:.0f} ms vs cold {r['cold_ttft_ms']:.0f} ms "
              f"-> {r['ratio']:.3f}x (target <= 0.05x)")
    print(_swa_line(swa))


def _swa_line(s: dict) -> str:
    return (f"{s['model']} SWA cache at 8k context: KV full {s['full']['kv_mib']:.0f} MiB, small {s['small']['kv_mib']:.0f} MiB "
            f"({s['kv_full_over_small']:.1f}x less); 40-turn TTFT turn 2 / turn 40: full {s['full']['ttft_turn2_ms']:.0f} / "
            f"{s['full']['ttft_turn40_ms']:.0f} ms, small {s['small']['ttft_turn2_ms']:.0f} / {s['small']['ttft_turn40_ms']:.0f} ms "
            f"(turn 40 small/full {s['ttft40_small_over_full']:.2f}x)")


if __name__ == "__main__":
    main()
