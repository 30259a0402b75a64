"""One namespace for conversations: `run --session` and `sessions rm|rename` take the chat app's
conversation ids and `run --session NAME`'s names alike, and refuse a name two conversations share."""

from __future__ import annotations

import json

from edgechat.store import open_store
from tests.test_cli import assert_one_line_error, edgechat


def app_conversation(paths):
    """A conversation as the chat app stores it: an id, a title, no name."""
    store = open_store(paths)
    try:
        conv = store.create_conversation(model="smollm2-135m-instruct", settings={"system_prompt": "Answer in one word."})
        store.add_message(conv.id, "user", "What is the capital of France?")
        store.add_message(conv.id, "assistant", "Paris.")
        return conv
    finally:
        store.close()


def conversations(paths) -> dict[str, int]:
    store = open_store(paths)
    try:
        return {c.id: store.count_messages(c.id) for c in store.list_conversations()}
    finally:
        store.close()


def test_run_session_continues_an_app_conversation_by_its_id(isolated_dirs):
    conv = app_conversation(isolated_dirs)
    proc = edgechat("run", "--session", conv.id, "--json", "--temperature", "0", "--max-tokens", "8", "And of Italy?")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["session"] == conv.id
    assert conversations(isolated_dirs) == {conv.id: 4}
    header, row = edgechat("sessions").stdout.splitlines()
    assert header.split() == ["ID", "NAME", "MESSAGES", "UPDATED", "TITLE"]
    assert row.split()[:3] == [conv.id, "-", "4"] and row.endswith("What is the capital of France?")
    removed = edgechat("sessions", "rm", conv.id)
    assert removed.returncode == 0 and removed.stdout.strip() == f"deleted {conv.id}"
    assert conversations(isolated_dirs) == {}


def test_a_name_two_conversations_share_is_refused_with_both_listed(isolated_dirs):
    app = app_conversation(isolated_dirs)
    store = open_store(isolated_dirs)
    # what an earlier `run --session ID` left: a second conversation named like the first one's id
    named = store.create_conversation(title=app.id, name=app.id)
    store.close()
    for args in (("run", "--session", app.id, "--max-tokens", "4", "And of Italy?"), ("sessions", "rm", app.id)):
        assert_one_line_error(edgechat(*args), f"'{app.id}' names 2 conversations", app.id, named.id,
                              f"edgechat sessions rename {named.id} NEW-NAME")
    assert conversations(isolated_dirs) == {app.id: 2, named.id: 0}
    renamed = edgechat("sessions", "rename", named.id, "old")
    assert renamed.returncode == 0, renamed.stderr
    proc = edgechat("run", "--session", app.id, "--temperature", "0", "--max-tokens", "4", "And of Italy?")
    assert proc.returncode == 0, proc.stderr
    assert conversations(isolated_dirs) == {app.id: 4, named.id: 0}
    # a name is never another conversation's id or name
    assert_one_line_error(edgechat("sessions", "rename", "old", app.id), f"'{app.id}' already names another conversation")
