"""Decode speed inside the chat app against the engine alone, on the same prompt and model.

    python -m bench.bench_tui [--model NAME] [--tokens N] [--rounds R] [--no-terminal]

Each round runs, on the same greedy request:
  engine          the engine consumed by a bare loop (what `edgechat run` does), in this process
  app (terminal)  the installed `edgechat` command in a real terminal (tmux), as a user runs it
  app (headless)  the app under Textual's headless driver, in this process
  app, per-token  the same with FLUSH_INTERVAL = MAX_INTERVAL = 0: every token goes to the UI
and prints the median decode tokens/s of each with its ratio to the engine (target >= 0.95), plus
the main thread's CPU share while streaming (the UI's work per second) for the in-process runs.
Numbers are only comparable on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from edgechat.config import get_paths
from edgechat.store import open_store
from edgechat.tui import config as tui_config
from edgechat.tui.app import EdgechatApp
from edgechat.tui.client import LocalClient
from edgechat.tui.widgets import chatview

#: greedy SmolLM2 answers this with a phrase repeated until max_tokens: a steady stream of a known length
PROMPT = "What is the capital of France?"


def settings(tokens: int) -> dict:
    return {**tui_config.CHAT_DEFAULTS, "temperature": 0.0, "seed": 1, "max_tokens": tokens}


def engine_round(client: LocalClient, tokens: int, prompt: str) -> tuple[float, int]:
    request = tui_config.build_request(settings(tokens), [{"role": "user", "content": prompt}], session=None)
    finished = client.submit(request).result()
    return finished.metrics.decode_tps, finished.metrics.completion_tokens


async def headless_round(client: LocalClient, tokens: int, prompt: str, data_dir: str) -> tuple[float, int, float]:
    """(decode tok/s, tokens, main-thread CPU seconds per second while streaming)."""
    app = EdgechatApp(get_paths(data_dir), client_factory=lambda ref: client)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.chat_screen
        while app.client is None:
            await pilot.pause(0.01)
        conv = app.store.create_conversation(settings=settings(tokens))
        await screen.open_conversation(conv.id)
        cpu, wall = time.thread_time(), time.perf_counter()
        await screen.send(prompt)
        while screen.turn is not None:
            await pilot.pause(0.05)
        share = (time.thread_time() - cpu) / (time.perf_counter() - wall)
        answer = app.store.messages(conv.id)[-1]
    app.store.close()
    return answer.meta["tok_s"], answer.meta["completion_tokens"], share


def terminal_round(model: str, tokens: int, prompt: str, data_dir: str) -> tuple[float, int]:
    """The installed command in tmux: type the prompt, wait for the stored answer, read its stats."""
    paths = get_paths(data_dir)
    paths.config.mkdir(parents=True, exist_ok=True)
    paths.config_file.write_text(f"[chat]\ntemperature = 0.0\nseed = 1\nmax_tokens = {tokens}\n")
    sock = f"edgechat-bench-{os.getpid()}"

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, check=False).stdout

    subprocess.run(
        [
            "tmux",
            "-L",
            sock,
            "new-session",
            "-d",
            "-x",
            "120",
            "-y",
            "40",
            f"edgechat --data-dir {data_dir} -m {model}",
        ],
        check=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "Message (Enter sends" not in tmux("capture-pane", "-p"):
            if time.monotonic() > deadline:
                raise RuntimeError("edgechat did not start in tmux")
            time.sleep(0.1)
        tmux("send-keys", "-l", prompt)
        tmux("send-keys", "Enter")
        store = open_store(paths)
        try:
            deadline = time.monotonic() + 600
            while True:
                convs = store.list_conversations()
                msgs = store.messages(convs[0].id) if convs else []
                if len(msgs) == 2 and msgs[1].meta.get("finish_reason"):
                    return msgs[1].meta["tok_s"], msgs[1].meta["completion_tokens"]
                if time.monotonic() > deadline:
                    raise RuntimeError("no answer in tmux")
                time.sleep(0.2)
        finally:
            store.close()
    finally:
        tmux("send-keys", "C-q")
        time.sleep(1)
        tmux("kill-server")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--prompt", default=PROMPT, help="e.g. 'Count from 1 to 1000.' for a growing Markdown list")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-terminal", action="store_true", help="skip the tmux run of the installed command")
    args = parser.parse_args()
    terminal = not args.no_terminal and shutil.which("tmux") and shutil.which("edgechat")

    names = ["engine", "app (terminal)", "app (headless)", "app, per-token"]
    tps: dict[str, list[float]] = {k: [] for k in names if terminal or k != "app (terminal)"}
    counts: dict[str, list[int]] = {k: [] for k in tps}
    shares: dict[str, list[float]] = {"app (headless)": [], "app, per-token": []}
    with tempfile.TemporaryDirectory() as tmp:
        client = LocalClient(args.model, get_paths(tmp))
        coalesced, ceiling = chatview.FLUSH_INTERVAL, chatview.MAX_INTERVAL
        try:
            engine_round(client, 16, args.prompt)  # warm-up: the first decode pays one-time costs
            for r in range(args.rounds):
                t, n = engine_round(client, args.tokens, args.prompt)
                tps["engine"].append(t)
                counts["engine"].append(n)
                if terminal:
                    t, n = terminal_round(args.model, args.tokens, args.prompt, f"{tmp}/term{r}")
                    tps["app (terminal)"].append(t)
                    counts["app (terminal)"].append(n)
                for name, interval in (("app (headless)", coalesced), ("app, per-token", 0.0)):
                    chatview.FLUSH_INTERVAL = interval
                    chatview.MAX_INTERVAL = ceiling if interval else 0.0
                    t, n, share = asyncio.run(
                        headless_round(client, args.tokens, args.prompt, f"{tmp}/{r}{interval}")
                    )
                    tps[name].append(t)
                    counts[name].append(n)
                    shares[name].append(share)
                chatview.FLUSH_INTERVAL, chatview.MAX_INTERVAL = coalesced, ceiling
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()), flush=True)
        finally:
            chatview.FLUSH_INTERVAL, chatview.MAX_INTERVAL = coalesced, ceiling
            client.close()

    base = statistics.median(tps["engine"])
    print(f"model {client.model_name}, {args.rounds} rounds, up to {args.tokens} tokens, prompt {args.prompt!r}")
    for name, values in tps.items():
        med = statistics.median(values)
        line = f"  {name:<16} {med:7.1f} tok/s  ratio {med / base:.3f}  (rounds {', '.join(f'{v:.1f}' for v in values)}"
        line += f"; tokens {counts[name]})"
        if name in shares:
            line += f"  main-thread CPU {statistics.median(shares[name]) * 100:.0f}%"
        print(line)


if __name__ == "__main__":
    main()
