"""Model lifecycle in `serve`: a request for a model that is not loaded, to its first token,
against llama-server started on the same file to its first answer; and the server's RSS after
unloading a model against before loading it.

edgechat's side is a running server (in this process) whose pool holds the embedded SmolLM2
unloaded: the time from sending a streamed 1-token /v1/completions for it to the first token
(the load included: reading the file, the context, the planner). llama-server's is from starting
its process on the same file to the answer of a 1-token /completion (bench_cold_start's
measure: /health polled every 10 ms); it pays for its process start, which a running server
does not, and that is the comparison a user of a multi-model server feels. Same threads and
context. Rounds alternate which side goes first, after one unmeasured warm-up each (the file
in the page cache for both). RSS is /proc/self/status VmRSS: as the server starts, before the
first load, after an answer, after the model is unloaded (keep_alive 0), and after each round's
unload (what the first load leaves for good, against what a leak would add per cycle). "Before
the first load" is the server up and through the HTTP stack's first use, none of it the model's
(this process is the client too): a model listing, a streamed POST (answered 404: no such
model) and the server's thread pool (Ollama's empty generate with keep_alive 0, which unloads
what is not loaded); those first uses took 3 MiB, which would otherwise count as the model's.
The unload's figure is split into anonymous memory and file-backed pages (library code the load
paged in, which the kernel may drop).

    python -m bench.bench_lifecycle [--rounds 5] [--threads 2] [--ctx 2048] [--json]

`--chat-app`: switching between two models the chat app holds loaded (SmolLM2 and Gemma 3, its
own pool, headless under Pilot): each round switches to the other model and asks it a short
question in a new conversation; measured from the switch to the model being ready (polled every
5 ms, so up to that much late) plus the answer's first-token time (the engine's own TTFT), the
pool's load counters checked to say no load happened. The first switch to Gemma 3, which loads
it, is the reference, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_cold_start import llama_server_first_answer, smollm2_gguf
from bench.llamabench import find_llama_server

MODEL = "smol"


def rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def warm_http(url: str) -> None:
    """The HTTP stack's first use, on both sides, without loading anything (see the docstring)."""
    httpx.get(f"{url}/v1/models", timeout=30).raise_for_status()
    body = {"model": "no-such-model", "prompt": "hi", "max_tokens": 1, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 404, r.status_code
        r.read()
    r = httpx.post(f"{url}/api/generate", json={"model": MODEL, "prompt": "", "keep_alive": 0}, timeout=30)
    assert r.json()["done_reason"] == "unload", r.text


def first_token(url: str) -> float:
    """Seconds from sending a streamed 1-token completion to its first token."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": True, "temperature": 0}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def wait_unloaded(url: str, model: str = MODEL) -> None:
    deadline = time.monotonic() + 60
    while True:
        states = {c["id"]: c["meta"]["state"] for c in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
        if states[model] == "unloaded":
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model} was not unloaded within 60 s")
        time.sleep(0.05)


def unload(url: str, model: str = MODEL) -> None:
    """A 1-token answer that unloads `model` after it (keep_alive 0), once it is gone."""
    body = {"model": model, "prompt": "hi", "max_tokens": 1, "keep_alive": 0, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status()
    wait_unloaded(url, model)


async def chat_app_switches(rounds: int, threads: int) -> dict:
    """(see --chat-app above) Seconds per switch: to ready, to the first token, and the loads done."""
    from edgechat.config import get_paths
    from edgechat.models import resolve_model
    from edgechat.tui.app import EdgechatApp

    # the user's cache: Gemma 3 is assembled there once, not per run
    models = [str(resolve_model(name, get_paths())) for name in ("smollm2-135m-instruct", "gemma3-270m")]
    with tempfile.TemporaryDirectory(prefix="edgechat-lifecycle-tui-") as data_dir:
        paths = get_paths(data_dir)
        paths.config.mkdir(parents=True, exist_ok=True)
        paths.config_file.write_text("[chat]\nmax_tokens = 4\ntemperature = 0.0\nseed = 1\n")
        app = EdgechatApp(paths, model=models[0], engine_options={"n_threads": threads})
        switches: list[dict] = []
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.chat_screen

            async def until(condition) -> None:
                deadline = time.monotonic() + 300
                while not condition():
                    if time.monotonic() > deadline:
                        raise RuntimeError("the chat app did not get there in 300 s")
                    await pilot.pause(0.005)

            async def ask() -> float:
                await screen.action_new()
                await screen.send(f"Say hi to {len(switches)}.")  # a new prompt each time: no prompt cache hit
                await until(lambda: screen.turn is None)
                return app.store.messages(screen.conv.id)[-1].meta["ttft"]

            await until(lambda: app.client is not None)
            await ask()
            for rnd in range(rounds * 2 + 1):  # the first switch loads Gemma 3; then back and forth
                target, engine = models[(rnd + 1) % 2], app.client.engine
                pool = app.local_models.pool
                loads = sum(m.loads for m in pool.models.values())
                start = time.perf_counter()
                app.load_model(target)
                await until(lambda old=engine: app.client is not None and app.client.engine is not old)
                ready = time.perf_counter() - start
                ttft = await ask()
                switches.append({"to": Path(target).name, "ready_s": ready, "first_token_s": ready + ttft,
                                 "loads": sum(m.loads for m in pool.models.values()) - loads})
                print(f"switch {rnd + 1}: to {Path(target).name}, ready {ready:.3f} s, first token {ready + ttft:.3f} s, "
                      f"{switches[-1]['loads']} load(s)", file=sys.stderr)
    return {"threads": threads, "cold": switches[0], "loaded": switches[1:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048, help="context size for both sides")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    ap.add_argument("--chat-app", action="store_true", help="switching between two loaded models in the chat app")
    args = ap.parse_args(argv)
    if args.chat_app:
        return report_chat_app(args)

    from edgechat.config import get_paths
    from edgechat.engine import EngineConfig
    from edgechat.engine.pool import ModelPool
    from edgechat.server import ServerSettings, create_app
    from tests.serving import serving

    server_bin = find_llama_server()
    model = smollm2_gguf()
    log = args.log_dir / "bench_lifecycle-llama-server.log"
    times: dict[str, list[float]] = {"edgechat": [], "llama-server": []}
    with tempfile.TemporaryDirectory(prefix="edgechat-lifecycle-") as data_dir:
        paths = get_paths(data_dir)
        pool = ModelPool()
        pool.add(MODEL, EngineConfig(model=str(model), n_ctx=args.ctx, n_threads=args.threads, n_parallel=1, paths=paths,
                                     prompt_cache_budget=64 << 20))
        try:
            with serving(create_app(ServerSettings(degrade_queue_wait=None), pool=pool)) as url:
                started = rss()
                warm_http(url)
                before, before_file = rss(), rss("RssFile")
                first_token(url)  # warm-up: the page cache, the model's hash for its snapshots
                loaded = rss()
                unload(url)
                after, after_file = rss(), rss("RssFile")
                later: list[int] = []  # after each round's unload: a leak would grow it
                llama_server_first_answer(server_bin, model, args.threads, args.ctx, log)
                sides = {
                    "edgechat": lambda: first_token(url),
                    "llama-server": lambda: llama_server_first_answer(server_bin, model, args.threads, args.ctx, log),
                }
                for rnd in range(args.rounds):
                    order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
                    for name in order:
                        times[name].append(sides[name]())
                        if name == "edgechat":
                            unload(url)
                            later.append(rss())
                    print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in order), file=sys.stderr)
        finally:
            pool.close()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    result = {
        "model": model.name,
        "threads": args.threads,
        "ctx": args.ctx,
        "median_s": med,
        "runs_s": times,
        "ratio": med["edgechat"] / med["llama-server"],
        "paired_ratio": statistics.median(a / b for a, b in zip(times["edgechat"], times["llama-server"], strict=True)),
        "rss_bytes": {"server_started": started, "before_load": before, "loaded": loaded, "after_unload": after, "after_each_later_unload": later},
        "rss_file_bytes": {"before_load": before_file, "after_unload": after_file},
        "rss_after_vs_before": after / before,
        "rss_last_vs_first_unload": later[-1] / after,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        mib = 1 << 20
        print(f"{model.name}, {args.threads} threads, ctx {args.ctx}, median of {args.rounds}:")
        print(f"  edgechat: request for an unloaded model to its first token   {med['edgechat']:6.2f} s")
        print(f"  llama-server: start to its first 1-token answer              {med['llama-server']:6.2f} s")
        print(f"  ratio edgechat / llama-server                                {result['ratio']:6.2f}x "
              f"(paired by round {result['paired_ratio']:.2f}x)")
        file_kept = after_file - before_file
        print(f"  server RSS: {started / mib:.0f} MiB started, {before / mib:.0f} MiB through the HTTP stack's first use, before the load, "
              f"{loaded / mib:.0f} MiB loaded, {after / mib:.0f} MiB after unloading ({result['rss_after_vs_before']:.3f}x of before: "
              f"+{(after - before - file_kept) / mib:.1f} MiB anonymous, +{file_kept / mib:.1f} MiB file-backed)")
        print(f"  after each later load and unload: {', '.join(f'{r / mib:.0f}' for r in later)} MiB "
              f"({result['rss_last_vs_first_unload']:.2f}x of the first unload's)")
    return 0


def report_chat_app(args) -> int:
    import asyncio

    result = asyncio.run(chat_app_switches(args.rounds, args.threads))
    warm = result["loaded"]
    assert all(s["loads"] == 0 for s in warm), "a switch to a loaded model loaded it again"
    result["median_loaded_first_token_s"] = statistics.median(s["first_token_s"] for s in warm)
    result["median_loaded_ready_s"] = statistics.median(s["ready_s"] for s in warm)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        cold = result["cold"]
        print(f"chat app, {args.threads} threads, {len(warm)} switches between two loaded models (median):")
        print(f"  switch to a loaded model: ready {result['median_loaded_ready_s']:.3f} s, "
              f"its answer's first token {result['median_loaded_first_token_s']:.3f} s, no load")
        print(f"  reference, the first switch to {cold['to']} (it loads): ready {cold['ready_s']:.3f} s, "
              f"first token {cold['first_token_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
