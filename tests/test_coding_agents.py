"""The coding agents people run, unchanged, against `edgechat serve` on the real
Qwen2.5-Coder-0.5B with no --ctx: Claude Code (Messages), Codex CLI (Responses) and opencode
(chat completions), from npm (installed once per machine into the bench cache; skipped with the
reason where npm or its registry is not at hand). Through a recording proxy: no request gets an
error, the agent's own tools are called and their results go back to the model, each run ends
by itself; Claude Code's prefix is read once: a later session and a session after a restart
reach their first token from the prompt cache. Claude Code runs with the two tools its task
needs: its full set is a ~19k-token prompt, 5-10 minutes of prefill on two shared cores
(bench/bench_coding_agents.py runs it whole)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_serve import _free_port, _start, _stop
from bench.coding_agents import APIS, git_repo, install_agents, offered_tools, recording_proxy, run_agent, tool_results

pytestmark = pytest.mark.slow

BUGGY = {"calc.py": "def add(a, b):\n    return a - b\n", "test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"}
#: what each agent is asked, naming its own tools: a 0.5B model follows a named tool far more often
PROMPTS = {
    "claude": "Read calc.py with the Read tool, then fix the bug in it with the Edit tool.",
    "codex": "Run `cat calc.py` with exec_command, then fix the bug in calc.py.",
    "opencode": "Use the read tool to read calc.py in the current folder, then fix the bug with the edit tool.",
}
AGENT_TIMEOUT_S = 1200
CLAUDE_TOOLS = "Read,Edit"


@pytest.fixture(scope="module")
def agent_bins():
    try:
        return install_agents()
    except RuntimeError as why:
        pytest.skip(f"coding agents not available: {why}")


@pytest.fixture(scope="module")
def serve(qwen_coder_path, tmp_path_factory):
    """Start (or restart) `edgechat serve` on the real model with no --ctx, its data folder (and
    so its disk prompt cache) kept across restarts; yields a function giving (url, stop)."""
    data = tmp_path_factory.mktemp("serve-data")
    logs = tmp_path_factory.mktemp("serve-logs")
    running: list = []

    def start() -> str:
        port = _free_port()
        cmd = [sys.executable, "-m", "edgechat", "serve", "-m", str(qwen_coder_path), "--port", str(port), "--data-dir", str(data),
               "--any-model-name"]
        running.append(_start(cmd, port, "serve", logs))
        return f"http://127.0.0.1:{port}"

    def stop() -> None:
        while running:
            _stop(running.pop())

    yield start, stop, logs / "serve.log"
    stop()


#: sessions an agent gets to have one of its tools called: a 0.5B model sampling at the agent's
#: own temperature now and then answers in words or writes the call as text; the server's part (no
#: request failed, the session ended by itself) is checked on every one
TOOL_LOOP_TRIES = 2


def _served(recorder, agent: str, run) -> list:
    """The run ended by itself and no request failed; the agent's API requests in order."""
    assert run.returncode is not None, f"{agent} did not end in {AGENT_TIMEOUT_S} s: {run.output[-2000:]}"
    failed = [(e.path, e.status, e.head[:300]) for e in recorder.exchanges if e.method == "POST" and e.status >= 400]
    assert not failed, failed
    posts = recorder.posts(APIS[agent])
    assert posts, f"{agent} sent nothing: {run.output[-2000:]}"
    return posts


def _tool_loop(posts) -> tuple[set, set]:
    """(the tools the agent offered, those whose results went back to the model)"""
    return set().union(*(offered_tools(e.body) for e in posts)), {name for e in posts for name in tool_results(e.body)}


def _sessions(agent: str, agent_bins, url: str, tmp_path: Path, **kw) -> list[list]:
    """Sessions of `agent`, each in a fresh copy of the buggy repo, until one has a tool of its
    own called and its result sent back (at most TOOL_LOOP_TRIES); each session's requests."""
    sessions = []
    for attempt in range(TOOL_LOOP_TRIES):
        repo = git_repo(tmp_path / f"repo-{attempt}", BUGGY)
        with recording_proxy(url) as (proxy, recorder):
            run = run_agent(agent, agent_bins, proxy, repo, PROMPTS[agent], tmp_path / "home", AGENT_TIMEOUT_S, **kw)
        sessions.append(_served(recorder, agent, run))
        offered, returned = _tool_loop(sessions[-1])
        if returned & offered:
            return sessions
    raise AssertionError(f"no result of {agent}'s own tools went back in {TOOL_LOOP_TRIES} sessions (offered {sorted(offered)}, "
                         f"returned {sorted(returned)}): {run.output[-1500:]}")


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("agent", ["codex", "opencode"])
def test_the_agent_runs_its_tool_loop_to_the_end(agent, agent_bins, serve, tmp_path):
    start, stop, _ = serve
    url = start()
    try:
        _sessions(agent, agent_bins, url, tmp_path)
    finally:
        stop()


def _first_token(posts) -> float:
    """The first-token time of a session's first request that offers tools (Claude Code's first
    request is a one-token check without them)."""
    main = next(e for e in posts if offered_tools(e.body))
    assert main.first_token_s is not None, main.head[:500]
    return main.first_token_s


@pytest.mark.timeout(2400)
def test_claude_code_runs_and_its_prefix_is_read_once(agent_bins, serve, tmp_path):
    start, stop, log = serve
    url = start()
    cold = _first_token(_sessions("claude", agent_bins, url, tmp_path, max_turns=2, tools=CLAUDE_TOOLS)[0])
    repo = tmp_path / "repo-0"
    # the folder as it was: Claude Code's system prompt holds its git status (and the user's
    # home, in its memory folder's path), ahead of the tools
    subprocess.run(["git", "checkout", "-q", "."], cwd=repo, check=True)
    subprocess.run(["git", "clean", "-qfdx"], cwd=repo, check=True)
    # a new session in the same folder: the system prompt and tools come from the cache
    with recording_proxy(url) as (proxy, recorder):
        run_agent("claude", agent_bins, proxy, repo, PROMPTS["claude"], tmp_path / "home", AGENT_TIMEOUT_S, max_turns=1, tools=CLAUDE_TOOLS)
    warm = _first_token(recorder.posts(APIS["claude"]))
    stop()
    # and after a restart, from the disk cache the server wrote as it stopped
    url = start()
    try:
        with recording_proxy(url) as (proxy, recorder):
            run_agent("claude", agent_bins, proxy, repo, PROMPTS["claude"], tmp_path / "home", AGENT_TIMEOUT_S, max_turns=1, tools=CLAUDE_TOOLS)
        restarted = _first_token(recorder.posts(APIS["claude"]))
    finally:
        stop()
    assert warm <= 0.3 * cold and restarted <= 0.3 * cold, (cold, warm, restarted, Path(log).read_text()[-3000:])
