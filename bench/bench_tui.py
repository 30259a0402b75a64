"""Decode speed inside the chat app against the engine alone, on the same prompt and model.

    python -m bench.bench_tui [--model NAME] [--tokens N] [--rounds R]

Runs alternate rounds of (a) the engine consumed by a bare loop and (b) the same request sent
through the Textual app (headless, full layout and Markdown rendering), and prints the median
decode tokens/s of each and their ratio (target >= 0.95). A third variant sends every token to
the UI (FLUSH_INTERVAL = 0) to show what coalescing buys. Also prints the time from creating the
app to a usable input. Numbers are only comparable on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from edgechat.config import get_paths
from edgechat.tui import config as tui_config
from edgechat.tui.app import EdgechatApp
from edgechat.tui.client import LocalClient
from edgechat.tui.widgets import chatview

PROMPT = "Count from 1 to 1000, separated by commas."


def settings(tokens: int) -> dict:
    return {**tui_config.CHAT_DEFAULTS, "temperature": 0.0, "seed": 1, "max_tokens": tokens}


def engine_round(client: LocalClient, tokens: int) -> tuple[float, int]:
    request = tui_config.build_request(settings(tokens), [{"role": "user", "content": PROMPT}], session=None)
    finished = client.submit(request).result()
    return finished.metrics.decode_tps, finished.metrics.completion_tokens


async def app_round(client: LocalClient, tokens: int, data_dir: str) -> tuple[float, int, float]:
    paths = get_paths(data_dir)
    start = time.perf_counter()
    app = EdgechatApp(paths, client_factory=lambda ref: client)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        while app.client is None:
            await pilot.pause(0.01)
        startup = time.perf_counter() - start
        conv = app.store.create_conversation(settings=settings(tokens))
        await screen.open_conversation(conv.id)
        await screen.send(PROMPT)
        while screen.turn is not None:
            await pilot.pause(0.05)
        answer = app.store.messages(conv.id)[-1]
    app.store.close()
    return answer.meta["tok_s"], answer.meta["completion_tokens"], startup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        client = LocalClient(args.model, get_paths(tmp))
        try:
            engine_round(client, 16)  # warm-up: first decode pays one-time costs
            results: dict[str, list[float]] = {"engine": [], "app": [], "app, per-token updates": []}
            counts: dict[str, list[int]] = {k: [] for k in results}
            startups = []
            coalesced = chatview.FLUSH_INTERVAL
            for r in range(args.rounds):
                tps, n = engine_round(client, args.tokens)
                results["engine"].append(tps)
                counts["engine"].append(n)
                chatview.FLUSH_INTERVAL = coalesced
                tps, n, startup = asyncio.run(app_round(client, args.tokens, f"{tmp}/app{r}"))
                results["app"].append(tps)
                counts["app"].append(n)
                startups.append(startup)
                chatview.FLUSH_INTERVAL = 0.0
                tps, n, _ = asyncio.run(app_round(client, args.tokens, f"{tmp}/tok{r}"))
                results["app, per-token updates"].append(tps)
                counts["app, per-token updates"].append(n)
            chatview.FLUSH_INTERVAL = coalesced
        finally:
            client.close()

    base = statistics.median(results["engine"])
    print(f"model {client.model_name}, {args.rounds} rounds, up to {args.tokens} tokens, prompt {PROMPT!r}")
    for name, values in results.items():
        med = statistics.median(values)
        print(
            f"  {name:<24} {med:7.1f} tok/s (median of {', '.join(f'{v:.1f}' for v in values)}; "
            f"tokens {counts[name]})  ratio {med / base:.3f}"
        )
    print(f"  app start to usable input (headless, model already loaded): median {statistics.median(startups):.2f}s")


if __name__ == "__main__":
    main()
