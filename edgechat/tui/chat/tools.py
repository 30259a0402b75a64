"""Tools: the conversation's enabled MCP tools offered to an answer, each call it makes asked
about (`ToolApprovalScreen`), run off the UI thread and answered again, up to `TOOL_STEPS`
answers in a row; `/tools` lists, enables and disables them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from functools import partial

from textual.worker import Worker

from edgechat.engine.output.tools import tool_grammar
from edgechat.engine.types.request import ChatRequest
from edgechat.errors import EdgechatError, StoreError, UsageError
from edgechat.store import Conversation
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.screens.dialogs import ToolApprovalScreen
from edgechat.tui.toolrun import (
    CHOICES,
    DENIED,
    STOPPED,
    TOOL_STEPS,
    OfferedTools,
    call_line,
    offered_tools,
    split_name,
)
from edgechat.tui.widgets.chatview import MessageBox


class ToolsPart:
    def __init__(self, screen: ChatBase) -> None:
        self.screen = screen
        #: the tools offered to the answer being generated (None: none)
        self.offered: OfferedTools | None = None
        #: answers in a row that called tools since the question
        self.steps = 0
        #: the worker running an answer's calls (asking, running), and whether Esc stopped them
        self.running: Worker | None = None
        self.stopped = False

    def new_question(self) -> None:
        """A question (not the answer after tool calls): its answers may call tools again."""
        self.steps, self.stopped = 0, False

    def wanted(self, conv: Conversation) -> bool:
        """Whether the conversation's next answer is offered its tools."""
        return bool(conv.settings.get("tools")) and self.steps < TOOL_STEPS

    def offer(self, conv: Conversation, request: ChatRequest, box: MessageBox) -> Worker[None]:
        """Start the enabled tools' servers (off the UI thread: one may take seconds, or hang
        until its timeout), then generate with them offered."""
        return self.screen.run_worker(partial(self._offer, conv, request, box), group="offer-tools", thread=True,
                                      exclusive=True, exit_on_error=False)

    def _offer(self, conv: Conversation, request: ChatRequest, box: MessageBox) -> None:
        choice = conv.settings.get("tool_choice", "auto") if self.steps == 0 else "auto"
        offered, problems = None, []
        try:
            offered = offered_tools(self.screen.app.tool_servers, conv.settings["tools"], choice)
            problems = offered.skipped
            if offered.tools.active:
                request = dataclasses.replace(request, tools=offered.tools, grammar=tool_grammar(offered.tools, self.screen.client.tool_family))
            else:
                offered = None
        except EdgechatError as exc:  # a server that does not start, the SDK missing, a schema the grammar refuses
            offered, problems = None, [str(exc)]
        self.screen.app.call_from_thread(self._generate_offered, offered, problems, request, box)

    def _generate_offered(self, offered, problems: list[str], request: ChatRequest, box: MessageBox) -> None:
        for problem in problems:
            self.screen.notify(f"Tools: {problem}", severity="warning", timeout=10)
        self.offered = offered
        self.screen.chat.generate(self.screen.client, request, box)
        if self.stopped:  # Esc while the servers started
            self.screen.chat.cancel()

    def run_calls(self, conv_id: str, message_id: int, calls: list[dict], answer_again: Callable[[], Awaitable[None]]) -> None:
        """Each call the answer made: asked about (unless always allowed), run, its outcome stored
        and shown; then the model answers again with what came back (`answer_again`). Esc stops it."""
        self.steps += 1
        self.running = self.screen.run_worker(self._run_calls(conv_id, message_id, calls, answer_again),
                                              group="tool-calls", exclusive=True, exit_on_error=False)

    def stop(self) -> bool:
        """Esc: no more calls run for this question; False when none are running."""
        if self.running is None:
            return False
        self.stopped = True
        self.running.cancel()
        return True

    async def _run_calls(self, conv_id: str, message_id: int, calls: list[dict], answer_again: Callable[[], Awaitable[None]]) -> None:
        self.screen.status.state = "tools"
        try:
            for call in calls:
                await self._resolve(conv_id, call)
                self._save_calls(message_id, calls)
                await self._show_calls(message_id, calls)
            if not self.stopped and self.screen.conv is not None and self.screen.conv.id == conv_id:
                # (still this worker's until the answer is under way: nothing else may start between)
                await answer_again()
        except asyncio.CancelledError:
            for call in calls:
                if call["outcome"] in ("pending", "running"):
                    call.update(outcome="stopped", result=STOPPED)
            self._save_calls(message_id, calls)
            await self._show_calls(message_id, calls)
            raise
        finally:
            self.running = None
            if self.screen.turn is None:
                self.screen.status.state = "ready"

    async def _resolve(self, conv_id: str, call: dict) -> None:
        qualified = f"{call['server']}.{call['name']}"
        if self.stopped:
            call.update(outcome="stopped", result=STOPPED)
            return
        if not call["server"]:
            call.update(outcome="error", result=f"There is no tool named {call['name']!r}.")
            return
        conv = self.screen.store.get_conversation(conv_id)
        if conv is None:  # deleted while its calls waited: none of them runs
            call.update(outcome="stopped", result=STOPPED)
            return
        always = list(conv.settings.get("tools_always") or [])
        answer = "yes" if qualified in always else await self.screen.app.push_screen_wait(ToolApprovalScreen(call_line(call)))
        if answer == "always":
            self.screen.update_settings(conv, tools_always=always + [qualified])
        if answer == "stop":
            self.stopped = True
            call.update(outcome="stopped", result=STOPPED)
        elif answer == "no":
            call.update(outcome="denied", result=DENIED)
        else:
            call["outcome"] = "running"
            try:
                text, is_error = await asyncio.to_thread(self.screen.app.tool_servers.call, call["server"], call["name"], json.loads(call["arguments"]))
                call.update(outcome="error" if is_error else "ok", result=text)
            except EdgechatError as exc:  # the server crashed, hung or is gone: one line, and the model is told
                self.screen.notify(str(exc), severity="error", timeout=10)
                call.update(outcome="error", result=str(exc))

    def _save_calls(self, message_id: int, calls: list[dict]) -> None:
        try:
            self.screen.store.update_message(message_id, tool_calls=calls)
        except StoreError as exc:
            self.screen.store_failed(str(exc))

    async def _show_calls(self, message_id: int, calls: list[dict]) -> None:
        box = self.screen.box(message_id)
        if box is not None:
            await box.show_tool_calls([dict(c) for c in calls])

    def tools(self, arg: str = "") -> None:
        """/tools: list them, or turn some on or off in this conversation, or set how calls are made."""
        words = arg.split()
        if not words:
            turned_on = set((self.screen.conv.settings if self.screen.conv else {}).get("tools") or [])
            self.screen.run_worker(partial(self._list_tools, turned_on), group="list-tools", thread=True, exclusive=True,
                                   exit_on_error=False)
            return
        verb, names = words[0].lower(), words[1:]
        try:
            if verb in CHOICES and not names:
                changes: dict[str, object] = {"tool_choice": verb}
            elif verb in ("on", "off") and names:
                for name in names:
                    server, _ = split_name(name)
                    if server not in self.screen.app.config.mcp_servers:
                        raise UsageError(f"no MCP server {server!r} in config.toml; add [mcp.servers.{server}]")
                enabled = [t for t in (self.screen.conv.settings.get("tools") or []) if t not in names] if self.screen.conv else []
                changes = {"tools": enabled + (names if verb == "on" else [])}
            else:
                raise UsageError("/tools lists them; /tools on SERVER.TOOL… or off SERVER.TOOL…; /tools required or auto")
        except UsageError as exc:
            self.screen.notify(str(exc), severity="warning")
            return
        if self.screen.conv is None:
            try:
                self.screen.conv = self.screen.store.create_conversation(model=self.screen.client.model_name if self.screen.client else self.screen.app.model_ref,
                                                           settings=dict(self.screen.app.config.chat))
            except StoreError as exc:
                self.screen.store_failed(str(exc))
                return
            self.screen.refresh_sidebar()
        if self.screen.update_settings(self.screen.conv, **changes) is not None:
            enabled = self.screen.conv.settings.get("tools") or []
            choice = self.screen.conv.settings.get("tool_choice", "auto")
            self.screen.notify(f"Tools on in this conversation: {', '.join(enabled) or 'none'} (calls: {choice})")

    def _list_tools(self, enabled: set[str]) -> None:
        """Every configured server's tools (starting them: off the UI thread), as a note."""
        servers = self.screen.app.config.mcp_servers
        if not servers:
            lines = ["No MCP servers: add [mcp.servers.NAME] to config.toml (command, args, env; or a loopback url)."]
        else:
            lines = ["Tools (/tools on SERVER.TOOL to use one here):"]
            for name in servers:
                try:
                    for tool in self.screen.app.tool_servers.tools(name):
                        line = f"[{'on ' if f'{name}.{tool.name}' in enabled else 'off'}] {name}.{tool.name}"
                        lines.append(f"{line}: {tool.description.splitlines()[0]}" if tool.description.strip() else line)
                except EdgechatError as exc:
                    lines.append(f"{name}: {exc}")
        self.screen.app.call_from_thread(self._show_note, "\n".join(lines))  # type: ignore[arg-type]  # Textual's `T | Awaitable[T]` callback: mypy solves no T for a coroutine

    async def _show_note(self, text: str) -> None:
        await self.screen.chat.add_note(text)
        self.screen.chat.scroll_end(animate=False)
