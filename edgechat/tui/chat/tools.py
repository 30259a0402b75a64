"""Tools: the conversation's enabled MCP tools offered to an answer, each call it makes asked
about (`ToolApprovalScreen`), run off the UI thread and answered again, up to `TOOL_STEPS`
answers in a row; `/tools` lists, enables and disables them."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from textual import work

from edgechat.engine.output.tools import tool_grammar
from edgechat.engine.types.request import ChatRequest
from edgechat.errors import EdgechatError, StoreError, UsageError
from edgechat.store import Conversation
from edgechat.tui.chat.base import ChatBase
from edgechat.tui.screens.dialogs import ToolApprovalScreen
from edgechat.tui.toolrun import CHOICES, DENIED, STOPPED, call_line, offered_tools, split_name
from edgechat.tui.widgets.chatview import MessageBox


class ToolsPart(ChatBase):
    @work(thread=True, exclusive=True, group="offer-tools", exit_on_error=False)
    def _offer_tools(self, conv: Conversation, request: ChatRequest, box: MessageBox) -> None:
        """Start the enabled tools' servers (off the UI thread: one may take seconds, or hang
        until its timeout), then generate with them offered."""
        choice = conv.settings.get("tool_choice", "auto") if self._tool_steps == 0 else "auto"
        offered, problems = None, []
        try:
            offered = offered_tools(self.app.tool_servers, conv.settings["tools"], choice)
            problems = offered.skipped
            if offered.tools.active:
                request = dataclasses.replace(request, tools=offered.tools, grammar=tool_grammar(offered.tools, self.client.tool_family))
            else:
                offered = None
        except EdgechatError as exc:  # a server that does not start, the SDK missing, a schema the grammar refuses
            offered, problems = None, [str(exc)]
        self.app.call_from_thread(self._generate_offered, offered, problems, request, box)

    def _generate_offered(self, offered, problems: list[str], request: ChatRequest, box: MessageBox) -> None:
        for problem in problems:
            self.notify(f"Tools: {problem}", severity="warning", timeout=10)
        self._offered = offered
        self.chat.generate(self.client, request, box)
        if self._tools_stopped:  # Esc while the servers started
            self.chat.cancel()

    @work(exclusive=True, group="tool-calls", exit_on_error=False)
    async def _run_calls(self, conv_id: str, message_id: int, calls: list[dict]) -> None:
        """Each call the answer made: asked about (unless always allowed), run, its outcome stored
        and shown; then the model answers again with what came back. Esc stops it."""
        self.status.state = "tools"
        try:
            for call in calls:
                await self._resolve(conv_id, call)
                self._save_calls(message_id, calls)
                await self._show_calls(message_id, calls)
            if not self._tools_stopped and self.conv is not None and self.conv.id == conv_id:
                # (still this worker's until the answer is under way: nothing else may start between)
                await self.start_answer(user_id=None, prompt="", tool_step=True)
        except asyncio.CancelledError:
            for call in calls:
                if call["outcome"] in ("pending", "running"):
                    call.update(outcome="stopped", result=STOPPED)
            self._save_calls(message_id, calls)
            await self._show_calls(message_id, calls)
            raise
        finally:
            self._tool_run = None
            if self.turn is None:
                self.status.state = "ready"

    async def _resolve(self, conv_id: str, call: dict) -> None:
        qualified = f"{call['server']}.{call['name']}"
        if self._tools_stopped:
            call.update(outcome="stopped", result=STOPPED)
            return
        if not call["server"]:
            call.update(outcome="error", result=f"There is no tool named {call['name']!r}.")
            return
        conv = self.store.get_conversation(conv_id)
        if conv is None:  # deleted while its calls waited: none of them runs
            call.update(outcome="stopped", result=STOPPED)
            return
        always = list(conv.settings.get("tools_always") or [])
        answer = "yes" if qualified in always else await self.app.push_screen_wait(ToolApprovalScreen(call_line(call)))
        if answer == "always":
            self._update_settings(conv, tools_always=always + [qualified])
        if answer == "stop":
            self._tools_stopped = True
            call.update(outcome="stopped", result=STOPPED)
        elif answer == "no":
            call.update(outcome="denied", result=DENIED)
        else:
            call["outcome"] = "running"
            try:
                text, is_error = await asyncio.to_thread(self.app.tool_servers.call, call["server"], call["name"], json.loads(call["arguments"]))
                call.update(outcome="error" if is_error else "ok", result=text)
            except EdgechatError as exc:  # the server crashed, hung or is gone: one line, and the model is told
                self.notify(str(exc), severity="error", timeout=10)
                call.update(outcome="error", result=str(exc))

    def _save_calls(self, message_id: int, calls: list[dict]) -> None:
        try:
            self.store.update_message(message_id, tool_calls=calls)
        except StoreError as exc:
            self._store_failed(str(exc))

    async def _show_calls(self, message_id: int, calls: list[dict]) -> None:
        box = self._box(message_id)
        if box is not None:
            await box.show_tool_calls([dict(c) for c in calls])

    def action_tools(self, arg: str = "") -> None:
        words = arg.split()
        if not words:
            self._list_tools(set((self.conv.settings if self.conv else {}).get("tools") or []))
            return
        verb, names = words[0].lower(), words[1:]
        try:
            if verb in CHOICES and not names:
                changes: dict[str, object] = {"tool_choice": verb}
            elif verb in ("on", "off") and names:
                for name in names:
                    server, _ = split_name(name)
                    if server not in self.app.config.mcp_servers:
                        raise UsageError(f"no MCP server {server!r} in config.toml; add [mcp.servers.{server}]")
                enabled = [t for t in (self.conv.settings.get("tools") or []) if t not in names] if self.conv else []
                changes = {"tools": enabled + (names if verb == "on" else [])}
            else:
                raise UsageError("/tools lists them; /tools on SERVER.TOOL… or off SERVER.TOOL…; /tools required or auto")
        except UsageError as exc:
            self.notify(str(exc), severity="warning")
            return
        if self.conv is None:
            try:
                self.conv = self.store.create_conversation(model=self.client.model_name if self.client else self.app.model_ref,
                                                           settings=dict(self.app.config.chat))
            except StoreError as exc:
                self._store_failed(str(exc))
                return
            self.refresh_sidebar()
        if self._update_settings(self.conv, **changes) is not None:
            enabled = self.conv.settings.get("tools") or []
            choice = self.conv.settings.get("tool_choice", "auto")
            self.notify(f"Tools on in this conversation: {', '.join(enabled) or 'none'} (calls: {choice})")

    @work(thread=True, exclusive=True, group="list-tools", exit_on_error=False)
    def _list_tools(self, enabled: set[str]) -> None:
        """Every configured server's tools (starting them: off the UI thread), as a note."""
        servers = self.app.config.mcp_servers
        if not servers:
            lines = ["No MCP servers: add [mcp.servers.NAME] to config.toml (command, args, env; or a loopback url)."]
        else:
            lines = ["Tools (/tools on SERVER.TOOL to use one here):"]
            for name in servers:
                try:
                    for tool in self.app.tool_servers.tools(name):
                        line = f"[{'on ' if f'{name}.{tool.name}' in enabled else 'off'}] {name}.{tool.name}"
                        lines.append(f"{line}: {tool.description.splitlines()[0]}" if tool.description.strip() else line)
                except EdgechatError as exc:
                    lines.append(f"{name}: {exc}")
        self.app.call_from_thread(self._show_note, "\n".join(lines))  # type: ignore[arg-type]  # Textual's `T | Awaitable[T]` callback: mypy solves no T for a coroutine

    async def _show_note(self, text: str) -> None:
        await self.chat.add_note(text)
        self.chat.scroll_end(animate=False)
