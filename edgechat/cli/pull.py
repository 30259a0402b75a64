"""`edgechat pull`: download a catalog model or a Hub GGUF once, so it runs offline from then on."""

from __future__ import annotations

import sys

import click

from edgechat.cli.common import data_dir_option
from edgechat.config import get_paths
from edgechat.errors import ModelNotFoundError, UsageError
from edgechat.models import catalog, hub, planner, read_model_info, speech
from edgechat.models.catalog import format_size
from edgechat.models.ggufinfo import read_projector_info


@click.command("pull")
@click.argument("ref")
@click.option("-y", "--yes", is_flag=True, help="Download even when the model will not fit in the memory free here.")
@click.option("--no-mmproj", "no_mmproj", is_flag=True,
              help="Leave out the model's vision projector (its mmproj GGUF): text only, and that much less to download.")
@data_dir_option
def pull_cmd(ref: str, yes: bool, no_mmproj: bool, data_dir: str | None) -> None:
    """Download REF once: a catalog name (see `edgechat models --catalog`), NAME:QUANT,
    hf:OWNER/REPO/FILE.gguf or OWNER/REPO:QUANT, with its vision projector where the catalog
    names one or the repo has one; or a speech model (whisper-base, a Piper voice such as
    en_US-lessac-medium). Interrupted downloads resume; every file is checked against
    the Hub's size and sha256 and not kept if it differs."""
    paths = get_paths(data_dir)
    if kind := speech.speech_kind(ref):
        try:
            found = speech.resolve_stt(ref, paths) if kind == "stt" else speech.resolve_tts(ref, paths)
        except hub.HubUnreachableError as exc:
            raise ModelNotFoundError(f"cannot download {ref}: {exc.why}; {'unset it' if hub.offline() else 'connect to the internet'} "
                                     "and run this again") from None
        click.echo(f"ready: {found}")
        return
    hub_ref = hub.pull_ref(ref)
    was_here = hub.cached(hub_ref, paths) is not None
    try:
        path = _pull(ref, hub_ref, was_here, yes, no_mmproj, paths)
        # a repo named without the catalog is listed for its projector only when the model comes
        # now: a pull of a model already here asks the Hub nothing
        projector = None if no_mmproj else hub.pull_projector(ref, paths, list_repo=not was_here)
    except hub.HubUnreachableError as exc:
        # the generic hint says to run `edgechat pull`: the command that just failed. With the
        # model here, only its projector was left to download
        todo = "unset it" if hub.offline() else "connect to the internet"
        what, other = (f"{ref}'s vision projector", ", or pass --no-mmproj for text only") if was_here else (ref, "")
        raise ModelNotFoundError(f"cannot download {what}: {exc.why}; {todo} and run this again{other}") from None
    # reading the header proves the download is a whole, loadable GGUF
    info = read_model_info(path)
    click.echo(f"ready: {path} ({format_size(info.size_bytes)}, {info.architecture}, {info.quant}, trained ctx {info.context_length})")
    if projector is not None:
        pinfo = read_projector_info(projector)
        click.echo(f"projector: {projector} ({format_size(pinfo.size_bytes)}, {pinfo.projector_type}; "
                   f"reads {' and '.join(pinfo.modalities) or 'nothing'})")


def _pull(ref: str, hub_ref: hub.HubRef, was_here: bool, yes: bool, no_mmproj: bool, paths):
    """The model's file, downloaded unless here (after asking where it will not fit)."""
    found = catalog.lookup(ref)
    if found:
        entry, cfile = found
        mmproj = None if no_mmproj else entry.mmproj
        if not was_here or (mmproj is not None and hub.cached_projector(ref, paths) is None):
            hub.check_reachable(ref)  # before saying what would be downloaded
            extra = f" + vision projector {format_size(mmproj.size)}" if mmproj else ""
            click.echo(f"{entry.name} {cfile.quant}: about {format_size(cfile.size)}{extra}, licence {entry.licence}, "
                       f"from {entry.repo}", err=True)
            # the projector runs beside the model: the two must fit together
            size = cfile.size + (mmproj.size if mmproj else 0)
            if not yes and not planner.weights_fit(size):
                _confirm_too_large(ref, size)
    else:
        # any Hub file: the listing gives its size (and its repo's projector's) before a byte is downloaded
        if not yes and not hub.offline() and (size := hub.download_size(hub_ref, paths, with_projector=not no_mmproj)) and not planner.weights_fit(size):
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
