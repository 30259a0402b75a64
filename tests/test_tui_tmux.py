"""Smoke test of the installed `edgechat` command in a real terminal (tmux): ask, quit, reopen, still there."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from edgechat.config import get_paths
from edgechat.store import open_store

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (shutil.which("tmux") and shutil.which("edgechat")), reason="needs tmux and an installed edgechat"
    ),
]

PLACEHOLDER = "Message (Enter sends"


class Tmux:
    def __init__(self, socket: str, env: dict):
        self.socket = socket
        self.env = env

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, env=self.env).stdout

    def start(self, command: str) -> None:
        subprocess.run(
            ["tmux", "-L", self.socket, "new-session", "-d", "-x", "100", "-y", "30", command],
            check=True,
            env=self.env,
        )

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p")

    def running(self) -> bool:
        return (
            subprocess.run(["tmux", "-L", self.socket, "has-session"], capture_output=True, env=self.env).returncode
            == 0
        )

    def wait_for(self, condition, timeout: float, what: str) -> float:
        start = time.monotonic()
        while not condition():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"timed out waiting for {what}; screen:\n{self.screen()}")
            time.sleep(0.05)
        return time.monotonic() - start

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, env=self.env)


@pytest.fixture
def tmux(isolated_dirs):
    env = {**os.environ, "EDGECHAT_DATA_DIR": str(isolated_dirs.data), "TERM": "xterm-256color"}
    t = Tmux(f"edgechat-test-{os.getpid()}", env)
    yield t
    t.kill()


def test_edgechat_in_tmux_keeps_the_conversation(tmux, isolated_dirs):
    isolated_dirs.config.mkdir(parents=True, exist_ok=True)
    isolated_dirs.config_file.write_text("[chat]\nmax_tokens = 12\ntemperature = 0.0\n")
    command = f"edgechat --data-dir {isolated_dirs.data}"

    tmux.start(command)
    startup = tmux.wait_for(lambda: PLACEHOLDER in tmux.screen(), 20, "the input")
    print(f"startup to usable input: {startup:.2f}s")
    tmux.tmux("send-keys", "-l", "Name a fruit.")
    tmux.tmux("send-keys", "Enter")
    tmux.wait_for(lambda: "Assistant" in tmux.screen(), 30, "the answer to start")
    tmux.wait_for(lambda: "(generating)" not in tmux.screen() and "tok/s" in tmux.screen(), 120, "the answer")
    store = open_store(get_paths(isolated_dirs.data))
    (conv,) = store.list_conversations()
    user, answer = store.messages(conv.id)
    assert (user.content, answer.status) == ("Name a fruit.", "complete")
    first_line = answer.content.strip().splitlines()[0][:20]
    assert first_line in tmux.screen()
    tmux.tmux("send-keys", "C-q")
    tmux.wait_for(lambda: not tmux.running(), 30, "edgechat to quit")

    tmux.start(command)
    tmux.wait_for(lambda: PLACEHOLDER in tmux.screen(), 20, "the input after a restart")
    assert "Name a fruit." in tmux.screen()  # listed in the sidebar
    tmux.tmux("send-keys", "C-q")
    tmux.wait_for(lambda: not tmux.running(), 30, "edgechat to quit")
    store.close()
