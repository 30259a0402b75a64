"""A model's own settings in config.toml (`[models."NAME"]`, e.g. gpu_layers = 20), laid into its
EngineConfig by the front end that builds it (`run`, `serve`, the chat app): the engine is handed
resolved values and reads no settings file."""

from __future__ import annotations

from dataclasses import replace

from edgechat.config import Paths, get_paths, load_settings, model_settings, read_chat_template
from edgechat.engine.planner import parse_gpu_layers
from edgechat.models.resolve import display_name, resolve_model


def own_settings(paths: Paths, ref: str | None) -> dict:
    """The `[models."NAME"]` table of the model `ref`, under the name as typed, else as shown
    (an embedded model's short name, a file's stem); {} when it has none."""
    if not load_settings(paths).get("models"):
        return {}  # no table at all: nothing to resolve the model's file for
    return model_settings(paths, ref) or model_settings(paths, display_name(ref, resolve_model(ref, paths)))


def with_model_settings(config):
    """`config` (an EngineConfig) with what its model's table sets where the front end set
    nothing: `gpu_layers` (checked now: a bad value fails before anything loads) and
    `chat_template` (the file's text)."""
    paths = config.paths or get_paths()
    own = own_settings(paths, config.model)
    changes = {}
    if config.n_gpu_layers is None and own.get("gpu_layers") is not None:
        changes["n_gpu_layers"] = parse_gpu_layers(own["gpu_layers"])
    if config.chat_template is None and own.get("chat_template") is not None:
        changes["chat_template"] = read_chat_template(own["chat_template"])
    return replace(config, **changes) if changes else config
