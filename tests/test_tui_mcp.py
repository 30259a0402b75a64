"""MCP servers for the chat app (issue 29): configured in config.toml, started on demand, their
tools listed and called; a server that crashes or hangs costs one line and a timeout. The server
is a real stdio MCP server written here on the `mcp` SDK."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from test_tui_layout import until

from edgechat.errors import UsageError
from edgechat.tui.config import load_config
from edgechat.tui.mcp import ServerConfig, ToolServerError, ToolServers, parse_servers

SERVER = textwrap.dedent('''
    import os, time
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("calc")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def crash() -> str:
        """Exit in the middle of the call."""
        os._exit(3)

    @server.tool()
    def hang() -> str:
        """Never answer."""
        time.sleep(3600)
        return ""

    server.run()
''')


@pytest.fixture
def calc(tmp_path):
    script = tmp_path / "calc_server.py"
    script.write_text(SERVER)
    return ServerConfig("calc", command=sys.executable, args=(str(script),))


def test_tools_are_listed_and_called_and_a_crash_or_hang_is_one_line(calc):
    servers = ToolServers({"calc": calc}, call_timeout=3)
    try:
        tools = {t.name: t for t in servers.tools("calc")}
        assert set(tools) == {"add", "crash", "hang"}
        assert tools["add"].function["parameters"]["required"] == ["a", "b"]
        assert servers.call("calc", "add", {"a": 2, "b": 3}) == ("5", False)
        with pytest.raises(ToolServerError) as crashed:
            servers.call("calc", "crash", {})
        assert "calc.crash failed" in str(crashed.value) and "\n" not in str(crashed.value)
        # started again on the next call
        assert servers.call("calc", "add", {"a": 20, "b": 22}) == ("42", False)
        with pytest.raises(ToolServerError) as hung:
            servers.call("calc", "hang", {})
        assert "did not answer within 3 s" in str(hung.value)
        assert servers.call("calc", "add", {"a": 1, "b": 1}) == ("2", False)
        # the tool's own error is a result the model reads, not a failure of the server
        text, is_error = servers.call("calc", "add", {"a": "x", "b": 1})
        assert is_error and text
    finally:
        servers.close()


def test_a_server_that_does_not_start_is_one_line(tmp_path):
    servers = ToolServers({"gone": ServerConfig("gone", command=str(tmp_path / "no-such-program"))})
    try:
        with pytest.raises(ToolServerError) as exc:
            servers.tools("gone")
        assert "the MCP server 'gone' did not start" in str(exc.value) and "\n" not in str(exc.value)
        with pytest.raises(UsageError, match=r"no MCP server 'other'"):
            servers.tools("other")
    finally:
        servers.close()


def test_servers_come_from_config_toml_and_only_local_ones(isolated_dirs):
    isolated_dirs.config_file.parent.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text(textwrap.dedent('''
        [mcp.servers.calc]
        command = "python3"
        args = ["calc.py"]
        env = { CALC_MODE = "fast" }

        [mcp.servers.web]
        url = "http://127.0.0.1:8931/mcp"
    '''))
    servers = load_config(isolated_dirs).mcp_servers
    assert servers["calc"] == ServerConfig("calc", command="python3", args=("calc.py",), env={"CALC_MODE": "fast"})
    assert servers["web"].url == "http://127.0.0.1:8931/mcp"
    for bad, message in [
        ({"x": {"url": "http://example.com/mcp"}}, "only local servers"),
        ({"x": {"command": "a", "url": "http://127.0.0.1/"}}, "either command"),
        ({"x": {"command": "a", "args": "b"}}, "args must be a list"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_servers(bad)


# ---- the chat app's tool loop (Pilot, on the real SmolLM2) --------------------------------------

@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_path):
    from edgechat.config import get_paths
    from edgechat.tui.client import LocalClient

    c = LocalClient(str(smollm2_path), get_paths(tmp_path_factory.mktemp("tui-mcp-engine")))
    yield c
    c.close()


@pytest.fixture
def paths(isolated_dirs, tmp_path):
    script = tmp_path / "calc_server.py"
    script.write_text(SERVER)
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text(textwrap.dedent(f'''
        [chat]
        max_tokens = 60
        temperature = 0.0
        seed = 7

        [mcp.servers.calc]
        command = {str(sys.executable)!r}
        args = [{str(script)!r}]
    '''))
    return isolated_dirs


def _app(paths, client):
    from edgechat.tui.app import EdgechatApp

    return EdgechatApp(paths, client_factory=lambda ref: client)


#: the model answers and the servers start within this (a hang guard)
WAIT = 180.0


def _asking(app) -> bool:
    from edgechat.tui.screens.dialogs import ToolApprovalScreen

    return isinstance(app.screen, ToolApprovalScreen)


def _settled(app) -> bool:
    s = app.chat_screen
    return s.turn is None and s.turn_part.waiting is None and s.tools.running is None and app.screen is s


async def _command(pilot, text: str) -> None:
    screen = pilot.app.chat_screen
    screen.prompt.set_text(text)
    screen.prompt.focus()
    await pilot.press("enter")
    await pilot.pause(0.05)


async def _ask(pilot, text: str) -> None:
    await _command(pilot, text)
    await until(pilot, lambda: _asking(pilot.app) or _settled(pilot.app), WAIT, "the call or the answer")


@pytest.mark.asyncio
async def test_a_forced_call_is_asked_run_and_answered_and_always_skips_the_question(paths, client):
    app = _app(paths, client)
    async with app.run_test(size=(50, 30)) as pilot:
        await until(pilot, lambda: app.client is not None, WAIT, "the model")
        screen = app.chat_screen
        await _command(pilot, "/tools on calc.add")
        await _command(pilot, "/tools required")
        await _command(pilot, "/tools")  # the servers' tools, which are on here
        await until(pilot, lambda: any("[on ] calc.add: Add two integers." in str(n.render()) for n in screen.query(".note")), WAIT,
                     "the list of tools")
        assert any("[off] calc.crash" in str(n.render()) for n in screen.query(".note"))
        await _ask(pilot, "What is 2 plus 3? Use the add tool.")
        assert _asking(app) and app.screen.line.startswith("calc.add(")
        await pilot.press("a")  # always: this call runs, and the next one is not asked about
        await until(pilot, lambda: _settled(app) or _asking(app), WAIT, "the answer after the call")
        assert not _asking(app)
        conv_id = screen.conv.id
        called, answer = app.store.messages(conv_id)[1:3]
        [call] = called.tool_calls
        args = json.loads(call["arguments"])
        assert (call["server"], call["name"], call["outcome"]) == ("calc", "add", "ok")
        assert call["result"] == str(args["a"] + args["b"])
        # the call syntax is never the answer's text; the answer came after the result
        assert "<tool_call>" not in called.content and answer.role == "assistant" and answer.content.strip()
        [block] = screen.box(called.id).tool_blocks()
        assert block.call["outcome"] == "ok" and not block.expanded
        # the model was given the call and its result
        from edgechat.store.history import model_messages

        sent = model_messages(app.store, conv_id)
        assert {"role": "tool", "content": call["result"], "tool_call_id": call["id"]} in sent
        await _ask(pilot, "And what is 4 plus 4? Use the add tool.")
        assert not _asking(app)  # "always" held
        await until(pilot, lambda: _settled(app), WAIT, "the second answer")
        second = [m for m in app.store.messages(conv_id) if m.tool_calls][-1]
        assert second.id != called.id and second.tool_calls[0]["outcome"] == "ok"
        await _command(pilot, f"/export {paths.data / 'out.md'}")
        await until(pilot, lambda: (paths.data / "out.md").is_file(), WAIT, "the export")
    exported = (paths.data / "out.md").read_text()
    assert f"calc.add({call['arguments']})" in exported and "Tool call" in exported
    # the calls survive a restart: stored, and shown when the conversation opens
    app = _app(paths, client)
    async with app.run_test(size=(50, 30)) as pilot:
        await until(pilot, lambda: app.client is not None, WAIT, "the model")
        await app.chat_screen.open_conversation(conv_id)
        await pilot.pause(0.1)
        blocks = [b for box in app.chat_screen.chat.boxes() for b in box.tool_blocks()]
        assert [b.call["id"] for b in blocks] == [call["id"], second.tool_calls[0]["id"]]


@pytest.mark.asyncio
async def test_a_denied_call_reaches_the_model_as_a_refusal(paths, client):
    from edgechat.store.history import model_messages
    from edgechat.tui.toolrun import DENIED

    app = _app(paths, client)
    async with app.run_test(size=(50, 30)) as pilot:
        await until(pilot, lambda: app.client is not None, WAIT, "the model")
        await _command(pilot, "/tools on calc.add")
        await _command(pilot, "/tools required")
        await _ask(pilot, "What is 2 plus 3? Use the add tool.")
        assert _asking(app)
        await pilot.press("n")
        await until(pilot, lambda: _settled(app) or _asking(app), WAIT, "the answer after the refusal")
        conv_id = app.chat_screen.conv.id
        [called] = [m for m in app.store.messages(conv_id) if m.tool_calls]
        assert called.tool_calls[0]["outcome"] == "denied"
        assert {"role": "tool", "content": DENIED, "tool_call_id": called.tool_calls[0]["id"]} in model_messages(app.store, conv_id)
        assert app.store.messages(conv_id)[-1].id > called.id  # the model answered after it


@pytest.mark.asyncio
async def test_a_server_that_crashes_mid_call_is_one_line_and_the_conversation_goes_on(paths, client):
    app = _app(paths, client)
    async with app.run_test(size=(50, 30)) as pilot:
        await until(pilot, lambda: app.client is not None, WAIT, "the model")
        await _command(pilot, "/tools on calc.crash")
        await _command(pilot, "/tools required")
        await _ask(pilot, "Run the crash tool.")
        assert _asking(app)
        await pilot.press("y")
        # one line on the screen (the screen stays live: the call ran off its thread)
        await until(pilot, lambda: any("calc.crash failed" in n.message for n in app._notifications), WAIT, "the line")
        await until(pilot, lambda: _settled(app) or _asking(app), WAIT, "the answer after the crash")
        while _asking(app):  # the model may try the tool again: refused, until it answers in words
            await pilot.press("n")
            await until(pilot, lambda: _settled(app) or _asking(app), WAIT, "the answer after a refusal")
        conv_id = app.chat_screen.conv.id
        called = next(m for m in app.store.messages(conv_id) if m.tool_calls)
        call = called.tool_calls[0]
        assert call["outcome"] == "error" and "calc.crash failed" in call["result"] and "\n" not in call["result"]
        assert app.store.messages(conv_id)[-1].id > called.id
        # and the conversation goes on: the next question is answered
        await _command(pilot, "/tools off calc.crash")
        await _ask(pilot, "Say hello.")
        assert _settled(app) and app.store.messages(conv_id)[-1].content.strip()


@pytest.mark.asyncio
async def test_esc_at_the_question_stops_the_calls_and_the_model_is_told(paths, client):
    from edgechat.store.history import model_messages
    from edgechat.tui.toolrun import STOPPED

    app = _app(paths, client)
    async with app.run_test(size=(50, 30)) as pilot:
        await until(pilot, lambda: app.client is not None, WAIT, "the model")
        await _command(pilot, "/tools on calc.add")
        await _command(pilot, "/tools required")
        await _ask(pilot, "What is 2 plus 3? Use the add tool.")
        assert _asking(app)
        await pilot.press("escape")
        await until(pilot, lambda: _settled(app), WAIT, "the stop")
        conv_id = app.chat_screen.conv.id
        messages = app.store.messages(conv_id)
        assert messages[-1].tool_calls[0]["outcome"] == "stopped"  # no answer after it
        assert model_messages(app.store, conv_id)[-1] == {"role": "tool", "content": STOPPED,
                                                          "tool_call_id": messages[-1].tool_calls[0]["id"]}


def test_without_the_sdk_the_app_says_how_to_get_tools(calc, monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)  # what an install without the extra has
    with pytest.raises(UsageError, match=r"pip install 'edgechat\[tools\]'"):
        ToolServers({"calc": calc}).tools("calc")
