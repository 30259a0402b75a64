"""Coding agents against `edgechat serve` and `llama-server --jinja` (issue 45): the same GGUF,
the same context, the same machine, one server after the other. Each agent (Claude Code, Codex
CLI, opencode; bench/coding_agents.py) gets small tasks, each in a fresh repo, checked by running
the repo's code; then a later session of the first task in the same folder (reset), whose first
token shows what the server kept of the agent's prefix.

Per agent and server: API errors (requests answered 4xx/5xx), tasks solved, wall time of each
session, first-token time of the first session's first request and of the later session's.
Targets: no API error; solved >= llama-server's; later first token <= 0.1x the first; the first
session's wall time <= 1.0x llama-server's.

    python -m bench.bench_coding_agents [--model PATH] [--agents claude,codex,opencode]
        [--tasks bugfix,rename,test] [--servers edgechat,llama-server] [--ctx 32768] [--timeout 900] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_serve import _free_port, _server
from bench.coding_agents import APIS, git_repo, install_agents, offered_tools, recording_proxy, run_agent, tool_results
from bench.llamabench import llama_tools_dir
from bench.realmodel import real_model_path

#: task: (files, prompt, check command run in the repo: exit 0 is solved)
TASKS = {
    "bugfix": (
        {"calc.py": "def add(a, b):\n    return a - b\n"},
        "calc.py has a bug: add(2, 3) should be 5. Read calc.py, then fix it.",
        [sys.executable, "-c", "from calc import add; assert add(2, 3) == 5"],
    ),
    "rename": (
        {"util.py": "def compute_total(xs):\n    return sum(xs)\n",
         "main.py": "from util import compute_total\n\nprint(compute_total([1, 2, 3]))\n"},
        "Rename the function compute_total to sum_all in util.py and in main.py.",
        [sys.executable, "-c", "import pathlib, subprocess, sys; t = pathlib.Path('util.py').read_text() + pathlib.Path('main.py').read_text();"
         " assert 'compute_total' not in t and 'def sum_all' in t; assert subprocess.run([sys.executable, 'main.py']).returncode == 0"],
    ),
    "test": (
        {"strings.py": "def reverse(s):\n    return s\n",
         "test_strings.py": "from strings import reverse\n\n\ndef test_reverse():\n    assert reverse('abc') == 'cba'\n"},
        "The test in test_strings.py fails. Change strings.py so that it passes.",
        [sys.executable, "-c", "from strings import reverse; assert reverse('abc') == 'cba'"],
    ),
}


def _server_cmd(server: str, model: Path, port: int, ctx: int) -> list[str]:
    if server == "edgechat":
        return [sys.executable, "-m", "edgechat", "serve", "-m", str(model), "--port", str(port), "--ctx", str(ctx),
                "--any-model-name"]
    return [str(llama_tools_dir("llama-server") / "llama-server"), "-m", str(model), "--port", str(port), "--jinja",
            "-c", str(ctx), "--no-webui"]


def _session(agent, bins, url, repo, prompt, home, timeout):
    with recording_proxy(url) as (proxy, recorder):
        run = run_agent(agent, bins, proxy, repo, prompt, home, timeout, max_turns=8 if agent == "claude" else None)
    posts = recorder.posts(APIS[agent])
    main = next((e for e in posts if offered_tools(e.body)), None)
    return {
        "ended": run.returncode is not None,
        "wall_s": round(run.wall_s, 1),
        "requests": len(posts),
        "api_errors": sum(1 for e in recorder.exchanges if e.method == "POST" and e.status >= 400),
        "tool_results": sum(len(tool_results(e.body)) > 0 for e in posts),
        "first_token_s": None if main is None or main.first_token_s is None else round(main.first_token_s, 1),
    }


def measure(server: str, model: Path, agents: list[str], tasks: list[str], ctx: int, timeout: float, work: Path) -> dict:
    bins = install_agents()
    out: dict = {}
    port = _free_port()
    with _server(_server_cmd(server, model, port, ctx), port, server, work) as url:
        for agent in agents:
            rows = {}
            for i, task in enumerate(tasks):
                files, prompt, check = TASKS[task]
                repo = git_repo(work / server / agent / task, files)
                # one home for the agent, as a user has: Claude Code names it in its system prompt
                home = work / server / agent / "home"
                row = _session(agent, bins, url, repo, prompt, home, timeout)
                row["solved"] = subprocess.run(check, cwd=repo, capture_output=True, timeout=60).returncode == 0
                if i == 0:
                    # a later session in the same folder, the repo as it was
                    subprocess.run(["git", "checkout", "-q", "."], cwd=repo, check=True)
                    subprocess.run(["git", "clean", "-qfdx"], cwd=repo, check=True)
                    row["later"] = _session(agent, bins, url, repo, prompt, home, timeout)
                rows[task] = row
                print(f"{server:12s} {agent:8s} {task:7s} {json.dumps(row)}", file=sys.stderr, flush=True)
            out[agent] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the real Qwen2.5-Coder-0.5B)")
    parser.add_argument("--agents", default="claude,codex,opencode")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--servers", default="edgechat,llama-server")
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--timeout", type=float, default=900, help="seconds an agent session may take")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = args.model or real_model_path()
    agents, tasks = args.agents.split(","), args.tasks.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench-agents-"))
    try:
        results = {s: measure(s, model, agents, tasks, args.ctx, args.timeout, work) for s in args.servers.split(",")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"model {model.name}, ctx {args.ctx}")
    print(f"{'agent':8s} {'server':12s} {'errors':>6s} {'solved':>6s} {'wall s':>8s} {'first tok':>9s} {'later tok':>9s}")
    for agent in agents:
        for server, by_agent in results.items():
            rows = by_agent[agent]
            first = rows[tasks[0]]
            print(f"{agent:8s} {server:12s} {sum(r['api_errors'] + r.get('later', {}).get('api_errors', 0) for r in rows.values()):6d} "
                  f"{sum(r['solved'] for r in rows.values()):3d}/{len(rows):<2d} {first['wall_s']:8.1f} "
                  f"{first['first_token_s'] or float('nan'):9.1f} {first['later']['first_token_s'] or float('nan'):9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
