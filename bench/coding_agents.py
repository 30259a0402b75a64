"""The coding agents people point at a local server, run as a user runs them: Claude Code
(Anthropic Messages), Codex CLI (Responses) and opencode (chat completions), from npm, each
non-interactively on a small repo, through a recording proxy that keeps every request's path,
body, status and first-byte time. Shared by tests/test_coding_agents.py and
bench/bench_coding_agents.py; never a dependency of the app.

The agents are installed once per machine into the bench cache (npm's own), pinned.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.realmodel import cache_dir

#: npm packages, pinned: an agent's requests change from release to release
PACKAGES = ("@anthropic-ai/claude-code@2.1.197", "@openai/codex@0.171.0", "opencode-ai@1.18.33")
BINS = {"claude": "claude", "codex": "codex", "opencode": "opencode"}
#: the API each agent speaks
APIS = {"claude": "/v1/messages", "codex": "/v1/responses", "opencode": "/v1/chat/completions"}
INSTALL_TIMEOUT_S = 600


def agents_dir() -> Path:
    return cache_dir().parent / "agents"


def install_agents() -> Path:
    """The folder of the agents' executables, installing them first where needed. Raises
    RuntimeError with one line saying why they cannot be had (no npm, no registry)."""
    bin_dir = agents_dir() / "node_modules" / ".bin"
    if all((bin_dir / b).exists() for b in BINS.values()):
        return bin_dir
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not on PATH: the coding agents come from npm (install node and npm)")
    agents_dir().mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(agents_dir()), *PACKAGES],
                              capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"npm install of the coding agents took over {INSTALL_TIMEOUT_S} s (is the registry reachable?)") from None
    if proc.returncode != 0 or not all((bin_dir / b).exists() for b in BINS.values()):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"npm could not install the coding agents: {last}")
    return bin_dir


# ---- the recording proxy ---------------------------------------------------------------------


@dataclass
class Exchange:
    """One request through the proxy."""

    method: str
    path: str
    body: dict | None
    status: int = 0
    first_byte_s: float | None = None  # from the request to the response body's first bytes
    first_token_s: float | None = None  # to the first event carrying text or a call
    total_s: float = 0.0
    head: bytes = b""  # the response body's first bytes (a stream's first events)


@dataclass
class Recorder:
    upstream: str  # host:port
    exchanges: list[Exchange] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def posts(self, api: str | None = None) -> list[Exchange]:
        with self.lock:
            return [e for e in self.exchanges if e.method == "POST" and (api is None or e.path.split("?")[0] == api)]


_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "accept-encoding"}
_HEAD_BYTES = 8192
#: the first answer text or call in a stream (keepalive comments and opening events come before):
#: Anthropic's content_block_delta, Responses' *.delta, chat's non-empty content or tool_calls;
#: a whole JSON answer has no such event and counts at its end
_TOKEN = re.compile(rb'content_block_delta|"response\.[a-z_.]*delta"|"content":\s*"[^"]|"tool_calls"')


def _handler(recorder: Recorder):
    class Proxy(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # the recorder is the log
            pass

        def _forward(self) -> None:
            start = time.monotonic()
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            ex = Exchange(self.command, self.path, body)
            with recorder.lock:
                recorder.exchanges.append(ex)
            conn = http.client.HTTPConnection(recorder.upstream, timeout=1800)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(self.command, self.path, body=raw or None, headers=headers)
            resp = conn.getresponse()
            ex.status = resp.status
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while self.command != "HEAD":
                chunk = resp.read1(65536)
                if not chunk:
                    break
                if ex.first_byte_s is None:
                    ex.first_byte_s = time.monotonic() - start
                if ex.first_token_s is None and _TOKEN.search(chunk):
                    ex.first_token_s = time.monotonic() - start
                if len(ex.head) < _HEAD_BYTES:
                    ex.head += chunk[: _HEAD_BYTES - len(ex.head)]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            if self.command != "HEAD":
                self.wfile.write(b"0\r\n\r\n")
            ex.total_s = time.monotonic() - start
            conn.close()

        def _guarded(self) -> None:
            try:
                self._forward()
            except (ConnectionError, TimeoutError):
                self.close_connection = True  # the agent left, or the server did: the exchange says so

        do_GET = do_POST = do_HEAD = do_DELETE = _guarded

    return Proxy


@contextlib.contextmanager
def recording_proxy(upstream_url: str):
    """A proxy on a free loopback port in front of `upstream_url`: yields (its URL, Recorder)."""
    recorder = Recorder(upstream_url.removeprefix("http://").rstrip("/"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(recorder))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", recorder
    finally:
        server.shutdown()
        server.server_close()


# ---- repos and runs --------------------------------------------------------------------------


def git_repo(path: Path, files: dict[str, str]) -> Path:
    """A fresh git repo holding `files`, committed."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "start"]):
        subprocess.run(cmd, cwd=path, check=True, env=env, capture_output=True)
    return path


@dataclass
class AgentRun:
    agent: str
    returncode: int | None  # None: stopped at the time limit
    wall_s: float
    output: str


def _agent_env(home: Path) -> dict[str, str]:
    """The agent's own config, state and caches under `home`, none of the user's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "OPENCODE_", "CLAUDE_"))}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"), NO_COLOR="1")
    return env


def run_agent(agent: str, bin_dir: Path, base_url: str, repo: Path, prompt: str, home: Path, timeout_s: float,
              max_turns: int | None = None, model: str = "local", tools: str | None = None) -> AgentRun:
    """One non-interactive session of `agent` in `repo` against `base_url` (the server's root);
    `tools` narrows Claude Code's built-in tools ("Read,Edit"), all of them when None."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**_agent_env(home), "PWD": str(repo)}  # opencode takes its project folder from $PWD
    exe = str(bin_dir / BINS[agent])
    if agent == "claude":
        # IS_SANDBOX: Claude Code refuses to skip its permission prompts as root elsewhere
        env.update(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY="none", IS_SANDBOX="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
        cmd = [exe, "-p", prompt, "--model", model, "--dangerously-skip-permissions",
               *(["--max-turns", str(max_turns)] if max_turns else []), *(["--tools", tools] if tools else [])]
    elif agent == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "local"\n[model_providers.local]\nname = "local"\n'
            f'base_url = "{base_url}/v1"\nwire_api = "responses"\nenv_key = "LOCAL_API_KEY"\n')
        env.update(CODEX_HOME=str(codex_home), LOCAL_API_KEY="none")
        cmd = [exe, "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", prompt]
    elif agent == "opencode":
        # every permission granted, as a user running it unattended does
        config = {"$schema": "https://opencode.ai/config.json", "model": f"local/{model}", "permission": "allow",
                  "provider": {"local": {"npm": "@ai-sdk/openai-compatible", "name": "local",
                                         "options": {"baseURL": f"{base_url}/v1", "apiKey": "none"}, "models": {model: {"name": model}}}}}
        (home / "opencode.json").write_text(json.dumps(config))
        env.update(OPENCODE_CONFIG=str(home / "opencode.json"))
        cmd = [exe, "run", prompt]
    else:
        raise ValueError(f"unknown agent {agent!r}")
    start = time.monotonic()
    try:
        # stdin closed: codex exec reads more of the prompt from a stdin left open
        proc = subprocess.run(cmd, cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
        return AgentRun(agent, proc.returncode, time.monotonic() - start, proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired as stopped:
        out = (stopped.stdout or b"") + (stopped.stderr or b"")
        return AgentRun(agent, None, time.monotonic() - start, out.decode(errors="replace") if isinstance(out, bytes) else out)


# ---- reading what went back and forth --------------------------------------------------------


def tool_results(body: dict | None) -> list[str]:
    """The names of the tools whose results a request gives back to the model, in any API."""
    if not body:
        return []
    names: dict[str, str] = {}
    found: list[str] = []
    for m in body.get("messages") or []:  # Anthropic's and chat completions'
        for c in m.get("tool_calls") or []:
            names[c.get("id")] = c.get("function", {}).get("name")
        if m.get("role") == "tool":
            found.append(names.get(m.get("tool_call_id"), "?"))
        if isinstance(m.get("content"), list):
            for b in m["content"]:
                if b.get("type") == "tool_use":
                    names[b.get("id")] = b.get("name")
                elif b.get("type") == "tool_result":
                    found.append(names.get(b.get("tool_use_id"), "?"))
    for item in body.get("input") or [] if isinstance(body.get("input"), list) else []:  # Responses'
        if item.get("type") in ("function_call", "custom_tool_call"):
            names[item.get("call_id")] = item.get("name")
        elif item.get("type") in ("function_call_output", "custom_tool_call_output"):
            found.append(names.get(item.get("call_id"), "?"))
    return found


def offered_tools(body: dict | None) -> set[str]:
    """The names of the tools a request offers (a namespace's functions by their own names)."""
    names: set[str] = set()
    for t in (body or {}).get("tools") or []:
        if t.get("type") == "namespace":
            names.update(f.get("name") for f in t.get("tools") or [])
        names.add(t.get("name") or t.get("function", {}).get("name"))
    return names - {None}
