"""MCP servers for the chat app: `[mcp.servers.NAME]` in config.toml, started on demand, their
tools listed and called with a timeout.

Only local transports: a command run over stdio (`command`, `args`, `env`) or a streamable HTTP
server on a loopback address (`url`). The sessions live on one event loop in a thread of their
own (the SDK's transports are anyio task groups, entered and left in one task), so a server that
crashes or hangs costs a call its timeout and one line (`ToolServerError`), never the screen.
The `mcp` SDK is an optional extra (`edgechat[tools]`): its pydantic core is compiled, and Termux
may have no wheel for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import json
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from edgechat.errors import EdgechatError, UsageError

if TYPE_CHECKING:
    from mcp import ClientSession

#: how long a server may take to start and list its tools, and one call to answer
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 60.0
#: the most characters of a result given back to the model (the rest is cut, and it says so)
MAX_RESULT_CHARS = 8000
INSTALL_HINT = "tools need the MCP SDK: pip install 'edgechat[tools]' (or pip install mcp)"


class ToolServerError(EdgechatError):
    """An MCP server that cannot start, crashed, hung or answered nonsense: one line."""


@dataclass(frozen=True)
class ServerConfig:
    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    url: str | None = None


@dataclass(frozen=True)
class ToolInfo:
    server: str
    name: str
    description: str
    schema: dict

    @property
    def function(self) -> dict:
        """The function the model is offered ({name, description, parameters})."""
        return {"name": self.name, "description": self.description, "parameters": self.schema}


def parse_servers(raw: object) -> dict[str, ServerConfig]:
    """`[mcp.servers.NAME]` tables -> configs; a wrong one is a UsageError naming it."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UsageError("[mcp.servers] in config.toml must be a table of servers")
    out = {}
    for name, spec in raw.items():
        where = f"[mcp.servers.{name}]"
        if not isinstance(spec, dict):
            raise UsageError(f"{where} must be a table with command (and args, env) or url")
        command, url = spec.get("command"), spec.get("url")
        if (command is None) == (url is None):
            raise UsageError(f"{where} needs either command (a program run over stdio) or url (a loopback HTTP server)")
        if command is not None:
            args, env = spec.get("args", []), spec.get("env", {})
            if not isinstance(command, str) or not command:
                raise UsageError(f"{where}: command must be a program name or path")
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise UsageError(f"{where}: args must be a list of strings")
            if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise UsageError(f"{where}: env must be a table of strings")
            out[name] = ServerConfig(name, command=command, args=tuple(args), env=dict(env))
        else:
            if not isinstance(url, str) or not _loopback(url):
                raise UsageError(f"{where}: url must be http://127.0.0.1, [::1] or localhost (only local servers)")
            out[name] = ServerConfig(name, url=url)
    return out


def _loopback(url: str) -> bool:
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    if parts.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(parts.hostname).is_loopback
    except ValueError:
        return False


def result_text(result) -> str:
    """A CallToolResult as the text the model reads back: its text parts, else its structured
    content as JSON; other parts are named, not sent."""
    parts = []
    for block in result.content or ():
        text = getattr(block, "text", None)
        parts.append(text if text is not None else f"[{getattr(block, 'type', 'content')} not shown]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n[cut: {len(text) - MAX_RESULT_CHARS} more characters]"
    return text


class ToolServers:
    """The configured servers, each started when first used; call from any thread but the loop's."""

    def __init__(self, configs: dict[str, ServerConfig], start_timeout: float = START_TIMEOUT_S, call_timeout: float = CALL_TIMEOUT_S):
        self.configs = configs
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sessions: dict[str, tuple[ClientSession, asyncio.Event, asyncio.Task]] = {}
        self._tools: dict[str, list[ToolInfo]] = {}
        self._lock = threading.Lock()

    # -- the loop thread ---------------------------------------------------------

    def _run(self, coro, timeout: float):
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True)
                self._thread.start()
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        if self._loop is None or self._thread is None:
            return
        with contextlib.suppress(Exception):
            self._run(self._close_all(), 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    async def _close_all(self) -> None:
        for name in list(self._sessions):
            await self._drop(name)

    async def _drop(self, name: str) -> None:
        entry = self._sessions.pop(name, None)
        self._tools.pop(name, None)
        if entry is None:
            return
        _, stop, task = entry
        stop.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 5)

    async def _hold(self, config: ServerConfig, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """One server's session, from start to stop, in one task (the SDK's transports need it)."""
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        try:
            if config.command is not None:
                params = StdioServerParameters(command=config.command, args=list(config.args), env=config.env or None)
                transport = stdio_client(params, errlog=_DEVNULL)
            else:
                from mcp.client.streamable_http import streamable_http_client

                assert config.url is not None  # (parse_servers: a command or a url)
                transport = streamable_http_client(config.url)
            async with transport as streams:
                async with ClientSession(streams[0], streams[1]) as session:
                    await session.initialize()
                    listed = await session.list_tools()
                    tools = [ToolInfo(config.name, t.name, t.description or "", t.input_schema or {"type": "object"}) for t in listed.tools]
                    ready.set_result((session, tools))
                    await stop.wait()
        except BaseException as exc:  # the server's own failure, whatever its type: reported, never raised here
            if not ready.done():
                ready.set_exception(ToolServerError(f"the MCP server {config.name!r} did not start: {_describe(exc)}"))

    async def _start(self, name: str) -> list[ToolInfo]:
        if name in self._sessions:
            return self._tools[name]
        loop = asyncio.get_running_loop()
        ready, stop = loop.create_future(), asyncio.Event()
        task = loop.create_task(self._hold(self.configs[name], ready, stop))
        try:
            session, tools = await asyncio.wait_for(ready, self.start_timeout)
        except asyncio.TimeoutError:
            stop.set()
            task.cancel()
            raise ToolServerError(f"the MCP server {name!r} did not answer within {self.start_timeout:g} s") from None
        self._sessions[name] = (session, stop, task)
        self._tools[name] = tools
        return tools

    async def _call(self, name: str, tool: str, arguments: dict):
        session = self._sessions[name][0]
        return await asyncio.wait_for(session.call_tool(tool, arguments), self.call_timeout)

    # -- the app's side -----------------------------------------------------------

    def tools(self, name: str) -> list[ToolInfo]:
        """The server's tools, starting it if it is not running."""
        _require_sdk()
        if name not in self.configs:
            raise UsageError(f"no MCP server {name!r} in config.toml; add [mcp.servers.{name}]")
        try:
            return self._run(self._start(name), self.start_timeout + 5)
        except ToolServerError:
            raise
        except BaseException as exc:
            raise ToolServerError(f"the MCP server {name!r} did not start: {_describe(exc)}") from None

    def call(self, server: str, tool: str, arguments: dict) -> tuple[str, bool]:
        """Run one call: (text for the model, whether the tool reported an error). A server
        that crashed or hung raises ToolServerError and is stopped, to be started again when
        next used."""
        self.tools(server)
        try:
            result = self._run(self._call(server, tool, arguments), self.call_timeout + 5)
        except BaseException as exc:
            self._run(self._drop(server), 10)
            if isinstance(exc, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
                raise ToolServerError(f"{server}.{tool} did not answer within {self.call_timeout:g} s; the server was stopped") from None
            raise ToolServerError(f"{server}.{tool} failed: {_describe(exc)}; the server was stopped") from None
        return result_text(result), bool(result.is_error)


def _describe(exc: BaseException) -> str:
    # an anyio task group wraps the real cause
    while inner := getattr(exc, "exceptions", None):
        exc = inner[0]
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def _require_sdk() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise UsageError(INSTALL_HINT) from None


#: where a stdio server's own log lines go: on the terminal they would draw over the screen
_DEVNULL = open(os.devnull, "w")
