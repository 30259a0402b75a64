"""The `edgechat` command: parsing and dispatch only; each command family lives in its own module."""

from __future__ import annotations

import sys

import click

from edgechat import __version__
from edgechat.cli.common import data_dir_option, gpu_layers_note, model_option, run_guarded
from edgechat.cli.engine_options import EngineOptions, engine_fields, engine_options


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="edgechat")
@model_option
@click.option("--url", default=None, help="Chat through an OpenAI-compatible server instead of a local model.")
@click.option("--api-key", default=None, envvar="EDGECHAT_API_KEY", help="API key for --url.")
@engine_options(per_model=False)
@data_dir_option
@click.pass_context
def cli(ctx: click.Context, model: str | None, url: str | None, api_key: str | None, options: EngineOptions, data_dir: str | None) -> None:
    """Offline LLM chat on your own machine. With no command, opens the chat app."""
    if ctx.invoked_subcommand is not None:
        return
    from edgechat.cli.chat import open_app
    from edgechat.config import get_paths

    if url is None:
        gpu_layers_note(options.gpu_layers, options.rpc)
    # the app's local models are built from these as `run` builds its one (tui/client.py)
    open_app(model=model, url=url, api_key=api_key, data_dir=data_dir, engine_options=engine_fields(options, model, get_paths(data_dir)))


def _register() -> None:
    from edgechat.cli import bench, models, pull, quantize, run, serve, sessions, tune, voice

    cli.add_command(run.run_cmd)
    cli.add_command(models.models_cmd)
    cli.add_command(models.doctor_cmd)
    cli.add_command(models.ps_cmd)
    for module in (sessions, serve, quantize, bench, pull, tune, voice):
        module.register(cli)


_register()


def main() -> None:
    run_guarded(cli, sys.argv[1:])
