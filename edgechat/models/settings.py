"""A model's own settings in config.toml (`[models."NAME"]`, e.g. gpu_layers = 20), laid into its
EngineConfig by the front end that builds it (`run`, `serve`, the chat app): the engine is handed
resolved values and reads no settings file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from edgechat.config import Paths, get_paths, load_settings, model_settings, read_chat_template
from edgechat.errors import EdgechatError, UsageError
from edgechat.models.ggufinfo import read_projector_info
from edgechat.models.planner import parse_gpu_layers
from edgechat.models.resolve import display_name, find_projector, resolve_model


def own_settings(paths: Paths, ref: str | None) -> dict:
    """The `[models."NAME"]` table of the model `ref`, under the name as typed, else as shown
    (an embedded model's short name, a file's stem); {} when it has none."""
    if not load_settings(paths).get("models"):
        return {}  # no table at all: nothing to resolve the model's file for
    return model_settings(paths, ref) or model_settings(paths, display_name(ref, resolve_model(ref, paths)))


def projector_for(paths: Paths, ref: str | None, path: Path, own: dict | None = None) -> Path | None:
    """The projector `edgechat run -m REF` loads for the model file `path`: its `mmproj` in
    config.toml (`own`: its table, where the caller read it already), else the one beside the
    file or pulled with it; None for a text-only model."""
    own = own_settings(paths, ref) if own is None else own
    return find_projector(str(own["mmproj"]) if own.get("mmproj") else None, path, ref, paths)


def with_model_settings(config):
    """`config` (an EngineConfig) with what its model's table sets where the front end set
    nothing: `gpu_layers` (checked now: a bad value fails before anything loads), `chat_template`
    (the file's text) and `mmproj` (a projector's path, checked to be one)."""
    paths = config.paths or get_paths()
    own = own_settings(paths, config.model)
    changes = {}
    if config.n_gpu_layers is None and own.get("gpu_layers") is not None:
        changes["n_gpu_layers"] = parse_gpu_layers(own["gpu_layers"])
    if config.chat_template is None and own.get("chat_template") is not None:
        changes["chat_template"] = read_chat_template(own["chat_template"])
    if config.mmproj is None and own.get("mmproj") is not None:
        changes["mmproj"] = _own_projector(own["mmproj"], config.model, paths)
    return replace(config, **changes) if changes else config


def _own_projector(value, model: str | None, paths: Paths) -> str:
    """A model's `mmproj` in config.toml, checked to be a projector's GGUF."""
    where = f"{paths.config_file}: mmproj for {model or 'the default model'}"
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where} must be the path of its mmproj GGUF, not {value!r}")
    path = Path(value).expanduser()
    try:
        read_projector_info(path)
    except EdgechatError as exc:
        raise UsageError(f"{where}: {exc}") from None
    return str(path)
