"""Scriptable conversations: `edgechat run --session NAME`, `edgechat sessions`, `sessions rm NAME`.

Each invocation is one turn of a stored conversation; its KV snapshot makes the next turn start
without re-reading the history.
"""

from __future__ import annotations

import json
import time

import click

from edgechat.cli.common import data_dir_option
from edgechat.config import get_paths
from edgechat.engine.request import ChatRequest, ContextPolicy
from edgechat.errors import UsageError
from edgechat.store import open_store
from edgechat.store.history import model_messages, with_system_prompt


def run_session_turn(cfg, name: str, text: str, system, sampling, max_tokens, stop, ignore_eos,
                     context_policy, as_json: bool) -> None:
    from edgechat.cli.run import result_json, stream_answer
    from edgechat.engine import Engine

    store = open_store(cfg.paths)
    try:
        conv = store.conversation_by_name(name, create=True)
        settings = dict(conv.settings or {})
        if system is not None:
            settings["system_prompt"] = system
        if context_policy is not None:
            settings["context_policy"] = context_policy
        if settings != (conv.settings or {}):
            store.update_conversation(conv.id, settings=settings)
            conv = store.get_conversation(conv.id)
        policy = ContextPolicy(settings.get("context_policy", ContextPolicy.SHIFT.value))
        with Engine(cfg) as engine:
            if engine.template_warning:
                click.echo(f"edgechat: warning: {engine.template_warning}", err=True)
            history = with_system_prompt(settings, model_messages(store, conv.id))
            # stored the moment it is sent: a crash mid-answer still keeps the question
            store.add_message(conv.id, "user", text)
            request = ChatRequest(
                messages=history + [{"role": "user", "content": text}],
                sampling=sampling,
                max_tokens=max_tokens,
                stop=stop,
                ignore_eos=ignore_eos,
                session=conv.id,
                context_policy=policy,
            )
            finished, evicted = stream_answer(engine, request, echo=not as_json)
            store.add_message(
                conv.id,
                "assistant",
                finished.text,
                status="interrupted" if finished.reason == "cancelled" else "complete",
                meta={"ttft": finished.metrics.ttft, "decode_tps": finished.metrics.decode_tps, "finish_reason": finished.reason},
            )
            if as_json:
                m = finished.metrics
                click.echo(json.dumps(result_json(engine, finished, session=name, cached_tokens=m.cached_tokens,
                                                  context_tokens=m.context_tokens, evicted_messages=evicted),
                                      ensure_ascii=False))
    finally:
        store.close()
    if finished.reason == "cancelled":
        raise KeyboardInterrupt  # the partial answer is stored; now exit as interrupted


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
    from edgechat.engine.kvcache import snapshot_path

    snapshot_path(paths.snapshots, conv.id).unlink(missing_ok=True)
    click.echo(f"deleted {name}")


def register(cli: click.Group) -> None:
    cli.add_command(sessions_group)
