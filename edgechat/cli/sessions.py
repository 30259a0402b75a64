"""`edgechat sessions`, `sessions rm REF` and `sessions rename REF NAME`: the stored conversations.

One namespace for every front end: a conversation is named by its id (the chat app's
conversations have only that) or by the name `edgechat run --session NAME` gave it.
"""

from __future__ import annotations

import time

import click

from edgechat.cli.common import data_dir_option
from edgechat.config import get_paths
from edgechat.errors import UsageError
from edgechat.store import Conversation, Store, open_store


def find_session(store: Store, ref: str, create: bool = False) -> Conversation | None:
    """The conversation REF names, by id or name; with `create`, a new one named REF if none.
    A REF that names two (a stored name equal to another conversation's id) is refused."""
    found = store.find_conversations(ref)
    if len(found) > 1:
        listed = " and ".join(_describe(store, c) for c in found)
        named = next(c for c in found if c.name == ref)
        raise UsageError(f"'{ref}' names {len(found)} conversations: {listed}; pick one by its id,"
                         f" or rename the named one: edgechat sessions rename {named.id} NEW-NAME")
    if found:
        return found[0]
    return store.create_conversation(title=ref, name=ref) if create else None


def _describe(store: Store, conv: Conversation) -> str:
    name = f"named {conv.name}, " if conv.name else ""
    return f"{conv.id} ({name}{store.count_messages(conv.id)} messages, \"{conv.title}\")"


@click.group("sessions", invoke_without_command=True)
@data_dir_option
@click.pass_context
def sessions_group(ctx, data_dir):
    """List the stored conversations, the chat app's and `run --session`'s: `run --session` and
    `sessions rm` take either the ID or the NAME."""
    ctx.obj = get_paths(data_dir)
    if ctx.invoked_subcommand is not None:
        return
    store = open_store(ctx.obj)
    try:
        rows = [
            (c.id, c.name or "-", str(store.count_messages(c.id)),
             time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated_at)), c.title)
            for c in store.list_conversations()
        ]
    finally:
        store.close()
    if not rows:
        click.echo("no sessions yet; start one with: edgechat run --session NAME \"Hello\"")
        return
    rows.insert(0, ("ID", "NAME", "MESSAGES", "UPDATED", "TITLE"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[4])


@sessions_group.command("rm")
@click.argument("ref", metavar="ID|NAME")
@click.pass_obj
def sessions_rm(paths, ref):
    """Delete a conversation (by its id or name) and its KV snapshot."""
    store = open_store(paths)
    try:
        conv = find_session(store, ref)
        if conv is None:
            raise UsageError(f"no session named '{ref}'; list them with: edgechat sessions")
        store.delete_conversation(conv.id)
    finally:
        store.close()
    from edgechat.engine.kv.snapshots import snapshot_path

    snapshot_path(paths.snapshots, conv.id).unlink(missing_ok=True)
    click.echo(f"deleted {ref}")


@sessions_group.command("rename")
@click.argument("ref", metavar="ID|NAME")
@click.argument("name")
@click.pass_obj
def sessions_rename(paths, ref, name):
    """Name a conversation (by its id or current name) for `run --session NAME`."""
    store = open_store(paths)
    try:
        conv = find_session(store, ref)
        if conv is None:
            raise UsageError(f"no session named '{ref}'; list them with: edgechat sessions")
        store.rename_conversation(conv.id, name)
    finally:
        store.close()
    click.echo(f"renamed {ref} to {name}")


def register(cli: click.Group) -> None:
    cli.add_command(sessions_group)
