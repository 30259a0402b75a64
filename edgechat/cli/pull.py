"""`edgechat pull`: download a catalog model or a Hub GGUF once, so it runs offline from then on."""

from __future__ import annotations

import sys

import click

from edgechat.cli.common import data_dir_option
from edgechat.config import get_paths
from edgechat.engine import planner
from edgechat.errors import ModelNotFoundError, UsageError
from edgechat.models import catalog, hub, read_model_info
from edgechat.models.catalog import format_size


@click.command("pull")
@click.argument("ref")
@click.option("-y", "--yes", is_flag=True, help="Download even when the model will not fit in the memory free here.")
@data_dir_option
def pull_cmd(ref: str, yes: bool, data_dir: str | None) -> None:
    """Download REF once: a catalog name (see `edgechat models --catalog`), NAME:QUANT,
    hf:OWNER/REPO/FILE.gguf or OWNER/REPO:QUANT. Interrupted downloads resume; every file is
    checked against the Hub's size and sha256 and not kept if it differs."""
    paths = get_paths(data_dir)
    try:
        path = _pull(ref, yes, paths)
    except hub.HubUnreachableError as exc:
        # the generic hint says to run `edgechat pull`: the command that just failed
        todo = "unset it" if hub.offline() else "connect to the internet"
        raise ModelNotFoundError(f"cannot download {ref}: {exc.why}; {todo} and run this again") from None
    # reading the header proves the download is a whole, loadable GGUF
    info = read_model_info(path)
    click.echo(f"ready: {path} ({format_size(info.size_bytes)}, {info.architecture}, {info.quant}, trained ctx {info.context_length})")


def _pull(ref: str, yes: bool, paths):
    hub_ref = hub.pull_ref(ref)
    found = catalog.lookup(ref)
    if found:
        entry, cfile = found
        if not hub.is_downloaded(entry, cfile, paths):
            hub.check_reachable(ref)  # before saying what would be downloaded
            click.echo(f"{entry.name} {cfile.quant}: about {format_size(cfile.size)}, licence {entry.licence}, from {entry.repo}", err=True)
            if not yes and not planner.weights_fit(cfile.size):
                _confirm_too_large(ref, cfile.size)
    else:
        # any Hub file: the listing gives its size before a byte is downloaded
        if not yes and not hub.offline() and (size := hub.download_size(hub_ref, paths)) and not planner.weights_fit(size):
            _confirm_too_large(ref, size)
    return hub.resolve_hub(hub_ref, paths)


def _confirm_too_large(ref: str, size: int) -> None:
    """Ask before a download the planner says will not run here; without a terminal to ask on, refuse."""
    free = format_size(planner.available_memory() * planner.headroom())
    question = f"{ref} ({format_size(size)}) will not fit in the memory free here ({free})"
    if not sys.stdin.isatty():
        raise UsageError(f"{question}; pass --yes to download it anyway")
    if not click.confirm(f"{question}. Download it anyway?", default=False, err=True):
        raise click.exceptions.Exit(1)


def register(cli: click.Group) -> None:
    cli.add_command(pull_cmd)
