"""Time from Enter to the first token of an answer about an attached file, in the chat app
(headless, the real engine), the first time and again (issue 29):

  first          a new conversation: the file and the question, nothing cached
  again          a second question in the same conversation: the file is in its KV cache
  new chat       the same file in another conversation (the engine's longest shared prefix)

Each row prints the wall time from the Enter key to the first text on screen, the engine's TTFT,
and the prompt's tokens and how many came from the cache.

Then a grounded answer (the file's first lines copied out) in a new conversation, once with the
app's `auto` speculation and once with it `off`: decode tok/s of each and their ratio, the
chat app's counterpart of `bench.bench_spec`'s quote task (both runs alternate, --spec-rounds).

    python -m bench.bench_attach [--model NAME] [--file-tokens 2000] [--threads N] [--spec-rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from edgechat.config import get_paths
from edgechat.tui.app import EdgechatApp
from edgechat.tui.client import LocalClient


def write_file(path: Path, client: LocalClient, tokens: int) -> int:
    """A made-up log of about `tokens` tokens (the model's count); returns its count."""
    from edgechat.engine import ChatRequest

    lines, i = [], 0
    while True:
        i += 1
        lines.append(f"{i:04d} station {i % 13}: pressure {1000 + i % 37} hPa, wind {i % 9} m/s, gusts {i % 23}")
        if i % 2 == 0:
            text = "\n".join(lines)
            n = client.count_tokens(ChatRequest(messages=[{"role": "user", "content": text}]))
            if n >= tokens:
                path.write_text(text + "\n")
                return n


async def ask(pilot, question: str) -> dict:
    app, screen = pilot.app, pilot.app.chat_screen
    screen.prompt.set_text(question)
    screen.prompt.focus()
    start = time.perf_counter()
    await pilot.press("enter")
    while screen.turn is None or not screen.turn.text:
        await pilot.pause(0.005)
    first = time.perf_counter() - start
    while screen.turn is not None:
        await pilot.pause(0.02)
    meta = app.store.messages(screen.conv.id)[-1].meta
    return {"enter_to_first_s": round(first, 3), "ttft_s": meta["ttft"], "prompt_tokens": meta["prompt_tokens"],
            "cached_tokens": meta["cached_tokens"], "tok_s": meta["tok_s"], "completion_tokens": meta.get("completion_tokens")}


QUOTE = "Copy the first twenty lines of weather.log exactly, one per line."


async def run(model: str, file_tokens: int, threads: int | None, spec_rounds: int) -> dict:
    data = tempfile.mkdtemp(prefix="bench-attach-")
    paths = get_paths(data)
    paths.config.mkdir(parents=True, exist_ok=True)
    paths.config_file.write_text("[chat]\ntemperature = 0.0\nseed = 1\nmax_tokens = 16\n")
    client = LocalClient(model, get_paths(tempfile.mkdtemp(prefix="bench-attach-engine-")),
                         engine_options={"n_threads": threads})
    file = Path(data) / "weather.log"
    counted = write_file(file, client, file_tokens)
    rows = {}
    try:
        app = EdgechatApp(paths, client_factory=lambda ref: client)
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.chat_screen
            while app.client is None:
                await pilot.pause(0.01)
            for name, question, new_chat in (
                ("first", "Which station had the highest pressure?", True),
                ("again", "And which had the strongest wind?", False),
                ("new chat", "Which station had the highest pressure?", True),
            ):
                if new_chat:
                    await screen.open_conversation(None)
                    screen.action_attach(str(file))
                    while not (screen.attach_bar.chips and screen.attach_bar.counted):
                        await pilot.pause(0.01)
                rows[name] = await ask(pilot, question)
        app.store.close()
        spec = {"auto": [], "off": []}
        for _ in range(spec_rounds):
            for mode in spec:
                spec[mode].append(await quote(client, file, mode))
    finally:
        client.close()
    ratios = [a["tok_s"] / o["tok_s"] for a, o in zip(spec["auto"], spec["off"], strict=True)]
    return {"model": client.model_name, "n_ctx": client.n_ctx, "threads": client.engine.n_threads,
            "file_tokens": counted, "rows": rows, "speculation": spec,
            "auto_over_off": round(statistics.median(ratios), 3) if ratios else None}


async def quote(client: LocalClient, file: Path, mode: str) -> dict:
    """The grounded answer in a new conversation of an app whose settings say `speculative = mode`."""
    paths = get_paths(tempfile.mkdtemp(prefix="bench-attach-"))
    paths.config.mkdir(parents=True, exist_ok=True)
    paths.config_file.write_text(f'[chat]\ntemperature = 0.0\nseed = 1\nmax_tokens = 200\nspeculative = "{mode}"\n')
    app = EdgechatApp(paths, client_factory=lambda ref: client)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        while app.client is None:
            await pilot.pause(0.01)
        screen.action_attach(str(file))
        while not (screen.attach_bar.chips and screen.attach_bar.counted):
            await pilot.pause(0.01)
        row = await ask(pilot, QUOTE)
    app.store.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--file-tokens", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: the physical cores)")
    parser.add_argument("--spec-rounds", type=int, default=2, help="auto/off pairs of the grounded answer")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.model, args.file_tokens, args.threads, args.spec_rounds))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['model']}, context {result['n_ctx']}, {result['threads']} threads, "
          f"attached file {result['file_tokens']} tokens")
    print(f"{'':10} {'Enter->1st':>10} {'TTFT':>8} {'prompt':>7} {'cached':>7}")
    for name, r in result["rows"].items():
        print(f"{name:10} {r['enter_to_first_s']:>9.3f}s {r['ttft_s']:>7.3f}s {r['prompt_tokens']:>7} "
              f"{r['cached_tokens']:>7}")
    for mode, runs in result["speculation"].items():
        print(f"grounded answer, speculative {mode}: " + ", ".join(f"{r['tok_s']:.1f} tok/s ({r['completion_tokens']} tokens)" for r in runs))
    print(f"auto / off: {result['auto_over_off']}x (median of pairs)")


if __name__ == "__main__":
    main()
