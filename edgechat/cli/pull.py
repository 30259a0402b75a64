"""`edgechat pull`: download a catalog model or a Hub GGUF once, so it runs offline from then on."""

from __future__ import annotations

import click

from edgechat.cli.common import data_dir_option
from edgechat.config import get_paths
from edgechat.errors import UsageError
from edgechat.models import catalog, hub, read_model_info
from edgechat.models.catalog import format_size


@click.command("pull")
@click.argument("ref")
@data_dir_option
def pull_cmd(ref: str, data_dir: str | None) -> None:
    """Download REF once: a catalog name (see `edgechat models --catalog`), NAME:QUANT,
    hf:OWNER/REPO/FILE.gguf or OWNER/REPO:QUANT. Interrupted downloads resume."""
    paths = get_paths(data_dir)
    found = catalog.lookup(ref)
    if found:
        entry, cfile = found
        hub_ref = hub.HubRef(entry.repo, cfile.file, cfile.quant, ref)
        if not hub.offline() and not hub.is_downloaded(entry, cfile, paths):
            click.echo(f"{entry.name} {cfile.quant}: about {format_size(cfile.size)}, licence {entry.licence}, from {entry.repo}", err=True)
    else:
        hub_ref = hub.parse_hub_ref(ref)
        if hub_ref is None:
            raise UsageError(f"'{ref}' is neither a catalog name nor a Hub reference; see: edgechat models --catalog")
    path = hub.resolve_hub(hub_ref, paths)
    # reading the header proves the download is a whole, loadable GGUF
    info = read_model_info(path)
    click.echo(f"ready: {path} ({format_size(info.size_bytes)}, {info.architecture}, {info.quant}, trained ctx {info.context_length})")


def register(cli: click.Group) -> None:
    cli.add_command(pull_cmd)
