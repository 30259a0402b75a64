"""The kill soak (issue 31): N turns of `edgechat run --session` on the embedded SmolLM2, every
`--kill-every`th one SIGKILLed at a random moment after its first streamed bytes. The prompts mix
English, Chinese, emoji, code and long pastes, in a 1024-token context so long histories evict.

After every turn the store is read back: a killed turn must have left its question with an answer
marked "interrupted" (its streamed text as of the last save, or empty), and the history the next
turn is built from (store/history.py's model_messages) must carry no question without an answer.
`PRAGMA integrity_check` runs every 25 turns and at the end. Prints turns, kills, failed turns
(non-zero exit or a traceback on a turn not killed), interrupted answers kept (with text / empty),
poisoned prompts (an unanswered question in a next prompt) and integrity checks:

    python -m bench.bench_kill_soak [--turns 300] [--kill-every 25] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from edgechat.store import Store
from edgechat.store.history import model_messages

PROMPTS = [
    "Name a color.",
    "What is the capital of France?",
    "请用一句话介绍长城。",
    "Reply with three emoji that describe the sea 🌊.",
    "Write a Python function that reverses a string.",
    "Explain what a hash map is in two sentences.",
    "Summarize this text:\n" + " ".join(f"Paragraph {i}: the river ran past the mill and the miller counted sacks." for i in range(40)),
]


def run_turn(data: Path, prompt: str, max_tokens: int, kill_after: float | None) -> tuple[int, str, bool]:
    """One turn; returns (exit status, stderr, whether it was killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgechat", "run", "--session", "soak", "--ctx", "1024", "--threads", "2",
         "--max-tokens", str(max_tokens), "--data-dir", str(data), prompt],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    if kill_after is not None:
        first = proc.stdout.read1(1)
        if first:
            time.sleep(kill_after)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return proc.returncode, "", True
    _, err = proc.communicate()
    return proc.returncode, err.decode(errors="replace"), False


def check(database: Path, integrity: bool) -> tuple[dict, bool | None]:
    store = Store.connect(database)
    try:
        (conv,) = store.list_conversations()
        last = store.messages(conv.id, limit=1)[0]
        history = model_messages(store, conv.id)
        # the next turn's prompt is this history plus its question: two questions in a row is poison
        poisoned = any(a["role"] == b["role"] == "user" for a, b in pairwise(history))
        ok = store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok" if integrity else None
        return {"last_role": last.role, "last_status": last.status, "last_text": bool(last.content),
                "poisoned": poisoned}, ok
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--kill-every", type=int, default=25, help="SIGKILL every Nth turn (default 25: 12 in 300)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    figures = {"turns": 0, "kills": 0, "failed_turns": 0, "interrupted_with_text": 0, "interrupted_empty": 0,
               "unmarked_after_kill": 0, "poisoned_prompts": 0, "integrity_checks": 0, "integrity_ok": 0}
    failures: list[str] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgechat-soak-") as tmp:
        data = Path(tmp)
        for i in range(1, args.turns + 1):
            killed_turn = i % args.kill_every == 0
            prompt = rng.choice(PROMPTS)
            rc, err, killed = run_turn(data, prompt, args.max_tokens, rng.uniform(0, 0.4) if killed_turn else None)
            figures["turns"] += 1
            if killed:
                figures["kills"] += 1
            elif rc != 0 or "Traceback" in err:
                figures["failed_turns"] += 1
                failures.append(f"turn {i}: rc {rc}: {err.strip()[-300:]}")
            integrity = i % 25 == 0 or i == args.turns
            state, ok = check(data / "edgechat.sqlite3", integrity)
            if killed:
                if state["last_role"] == "assistant" and state["last_status"] == "interrupted":
                    figures["interrupted_with_text" if state["last_text"] else "interrupted_empty"] += 1
                else:
                    figures["unmarked_after_kill"] += 1
            figures["poisoned_prompts"] += state["poisoned"]
            if ok is not None:
                figures["integrity_checks"] += 1
                figures["integrity_ok"] += ok
            if not args.json:
                print(f"\rturn {i}/{args.turns}  kills {figures['kills']}  failed {figures['failed_turns']}", end="", file=sys.stderr)
    figures["wall_s"] = round(time.monotonic() - start, 1)
    if not args.json:
        print(file=sys.stderr)
    print(json.dumps({**figures, "failures": failures}, indent=None if args.json else 2))
    bad = figures["failed_turns"] or figures["unmarked_after_kill"] or figures["poisoned_prompts"]
    return 1 if bad or figures["integrity_ok"] != figures["integrity_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
