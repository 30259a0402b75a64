"""The chat app's side of tool calling: a conversation's enabled MCP tools as the engine's `Tools`,
the calls an answer made, and what goes back to the model for each.

A conversation's settings hold `tools` (the enabled ones, "SERVER.TOOL"), `tools_always` (those
the user let run without asking) and `tool_choice` ("auto", or "required": the first answer
after a question must call one). The engine's tool grammar and parser are the server's
(engine/output/tools.py); a call's outcome is "ok", "error" (the tool's or its server's), "denied" or
"stopped" (Esc), and the model reads each as the call's result.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgechat.engine.output.tools import check_function
from edgechat.engine.types.request import ToolCall, Tools
from edgechat.errors import InvalidFieldError, UsageError
from edgechat.tui.mcp import ToolServers

#: answers in a row that may call tools; the one after them must answer in words
TOOL_STEPS = 6
CHOICES = ("auto", "required")
#: what the model reads back for a call the user refused, or stopped before it ran
DENIED = "The user declined to run this call. Answer without it."
STOPPED = "The user stopped the tools before this call ran."


@dataclass
class OfferedTools:
    tools: Tools
    #: function name -> the server that has it
    servers: dict[str, str]
    #: one line per enabled tool left out (gone from its server, or a schema the grammar cannot hold)
    skipped: list[str]


def split_name(qualified: str) -> tuple[str, str]:
    server, dot, tool = qualified.partition(".")
    if not dot or not server or not tool:
        raise UsageError(f"name a tool as SERVER.TOOL (got {qualified!r}); /tools lists them")
    return server, tool


def offered_tools(servers: ToolServers, enabled: list[str], choice: str) -> OfferedTools:
    """The enabled tools, their servers started; ToolServerError if a server does not start."""
    functions: list[dict] = []
    names: dict[str, str] = {}
    skipped: list[str] = []
    listed: dict[str, dict] = {}
    for qualified in enabled:
        server, tool = split_name(qualified)
        if server not in listed:
            listed[server] = {t.name: t for t in servers.tools(server)}
        info = listed[server].get(tool)
        if info is None:
            skipped.append(f"{qualified}: the server has no such tool now")
            continue
        if tool in names:
            skipped.append(f"{qualified}: {names[tool]}.{tool} has the same name")
            continue
        try:
            functions.append(check_function(qualified, info.function, functions))
        except InvalidFieldError as exc:
            skipped.append(str(exc))
            continue
        names[tool] = server
    # one call per answer: a small model held to calls may repeat one until its limit
    return OfferedTools(Tools(functions, choice if functions else "none", parallel=False), names, skipped)


def pending_call(call: ToolCall, server: str | None) -> dict:
    """A call as the store keeps it, before it has run."""
    return {"id": call.id, "server": server or "", "name": call.name, "arguments": call.arguments, "outcome": "pending", "result": ""}


def call_line(call: dict) -> str:
    """The one line a call shows: server.tool(arguments) and its outcome."""
    outcome = {"pending": "waiting", "ok": "done"}.get(call["outcome"], call["outcome"])
    return f"{call['server']}.{call['name']}({call['arguments']}) · {outcome}"
