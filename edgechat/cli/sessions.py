"""`edgechat sessions` and `sessions rm NAME`: the conversations `edgechat run --session NAME` keeps."""

from __future__ import annotations

import time

import click

from edgechat.cli.common import data_dir_option
from edgechat.config import get_paths
from edgechat.errors import UsageError
from edgechat.store import open_store


@click.group("sessions", invoke_without_command=True)
@data_dir_option
@click.pass_context
def sessions_group(ctx, data_dir):
    """List the stored conversations (NAME, messages, last used)."""
    ctx.obj = get_paths(data_dir)
    if ctx.invoked_subcommand is not None:
        return
    store = open_store(ctx.obj)
    try:
        rows = [c for c in store.list_conversations()]
        if not rows:
            click.echo("no sessions yet; start one with: edgechat run --session NAME \"Hello\"")
            return
        for c in rows:
            label = c.name or c.id
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated_at))
            click.echo(f"{label}\t{store.count_messages(c.id)} messages\t{when}\t{c.title}")
    finally:
        store.close()


@sessions_group.command("rm")
@click.argument("name")
@click.pass_obj
def sessions_rm(paths, name):
    """Delete the conversation NAME and its KV snapshot."""
    store = open_store(paths)
    try:
        conv = store.conversation_by_name(name, create=False) or store.get_conversation(name)
        if conv is None:
            raise UsageError(f"no session named '{name}'; list them with: edgechat sessions")
        store.delete_conversation(conv.id)
    finally:
        store.close()
    from edgechat.engine.snapshots import snapshot_path

    snapshot_path(paths.snapshots, conv.id).unlink(missing_ok=True)
    click.echo(f"deleted {name}")


def register(cli: click.Group) -> None:
    cli.add_command(sessions_group)
