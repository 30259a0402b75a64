"""What an empty conversation says while the model is one of the embedded demo models: that it is
a demo, and the one command that gets a real model, picked from the catalog to fit this machine."""

from __future__ import annotations

from edgechat.config import Paths
from edgechat.models.catalog import CatalogEntry, format_size, load_catalog
from edgechat.models.embedded import EMBEDDED


def suggest_model(available: int | None = None) -> CatalogEntry | None:
    """The largest catalog model whose default file the planner expects to fit in free memory."""
    from edgechat.models import planner

    fitting = [e for e in load_catalog().values() if planner.weights_fit(e.default.size, available)]
    return max(fitting, key=lambda e: e.default.size, default=None)


def welcome_markdown(model_ref: str | None, paths: Paths) -> str:
    """Markdown for the empty screen; "" when the model is not an embedded one (nothing to say).
    Reads free memory and the Hub cache: call it off the UI thread."""
    if model_ref not in EMBEDDED:
        return ""
    from edgechat.models.hub import cached_file

    intro = (
        f"**{model_ref}** is the small demo model that comes with edgechat: quick to load, "
        "but it often gets facts wrong."
    )
    entry = suggest_model()
    if entry is None:
        return intro + "\n\nNo catalog model fits this machine's free memory; `edgechat models --catalog` lists them."
    if cached_file(entry.repo, entry.default.file, paths) is not None:
        return intro + f"\n\n**{entry.name}** is downloaded and fits this machine: Ctrl+O, or `/model {entry.name}`."
    return (
        intro
        + f"\n\nFor real answers, download **{entry.name}** (~{format_size(entry.default.size)}, fits this machine):"
        + f"\n\n```\nedgechat pull {entry.name}\n```\n\nthen switch to it with Ctrl+O, or `/model {entry.name}`."
    )
