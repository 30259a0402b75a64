"""The engine's options, defined once for `run`, `serve` and the chat app (`edgechat` with no
command), and the one builder of an `EngineConfig` from them: an engine option means the same
(flag, default, config.toml fallback) wherever it is given."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import click

from edgechat.cli.common import (
    chat_template_option,
    deterministic_option,
    deterministic_setting,
    flash_attn_option,
    gpu_layers_option,
    kv_type_option,
    mmproj_for,
    mmproj_option,
    rpc_option,
    speculative_option,
    swa_cache_option,
)

ep_option = click.option("--ep", default=None, metavar="NAME",
                         help="ONNX models: onnxruntime execution provider (cpu, xnnpack, qnn, coreml, cuda).")


@dataclass(frozen=True)
class EngineOptions:
    """The engine options as parsed, before config.toml's fallbacks (`engine_config` lays them in)."""

    ctx: int | None = None
    threads: int | None = None
    gpu_layers: int | str | None = None
    rpc: list[str] = field(default_factory=list)
    kv_type: str = "f16"
    flash_attn: str = "auto"
    swa_cache: str = "auto"
    speculative: str = "auto"
    draft_model: str | None = None
    #: None: config.toml's `[engine] deterministic`, else off
    deterministic: bool | None = None
    #: a Jinja file's path (read when the config is built)
    chat_template: str | None = None
    #: --mmproj's FILE / MODEL=FILE values (common.mmproj_for assigns them)
    mmproj: dict[str | None, str] = field(default_factory=dict)
    ep: str | None = None


_NAMES = tuple(f.name for f in dataclasses.fields(EngineOptions))


def engine_options(func=None, *, many: bool = False, per_model: bool = True):
    """The engine's options on a command, handed to it as one `options: EngineOptions`. `many`:
    the command serves several models (--ctx's help names their own ctx); `per_model`: offer
    --chat-template and --ep, which suit only the model they are given with (the chat app
    switches models, so it has neither)."""
    if func is None:
        return lambda f: engine_options(f, many=many, per_model=per_model)

    @functools.wraps(func)
    def command(*args, **kwargs):
        given = {name: kwargs.pop(name) for name in _NAMES if name in kwargs}
        return func(*args, options=EngineOptions(**given), **kwargs)

    options = [
        click.option("--ctx", type=click.IntRange(min=64), default=None,
                     help="Context size in tokens (default: largest that fits, capped" + ("; per model: ctx in config.toml)." if many else ").")),
        click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: $EDGECHAT_THREADS, else the physical cores)."),
        gpu_layers_option, rpc_option, kv_type_option, flash_attn_option, swa_cache_option, speculative_option, deterministic_option,
        mmproj_option, *((chat_template_option, ep_option) if per_model else ()),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def engine_fields(options: EngineOptions, model: str | None, paths, refs: list[str | None] | None = None, first: bool = True) -> dict:
    """The `EngineConfig` fields the options set for `model`. `refs`: every model the command was
    given (MODEL=FILE of --mmproj names one of them; default: `model` alone); `first`: whether
    `model` is the one the draft model and chat template were given for (serve's first -m)."""
    from edgechat.config import read_chat_template

    return dict(
        n_ctx=options.ctx,
        n_threads=options.threads,
        n_gpu_layers=options.gpu_layers,
        rpc_servers=list(options.rpc or ()),
        kv_type=options.kv_type,
        flash_attn=options.flash_attn,
        swa_cache=options.swa_cache,
        speculative=options.speculative,
        draft_model=options.draft_model if first else None,
        deterministic=deterministic_setting(options.deterministic, paths),
        chat_template=read_chat_template(options.chat_template) if first else None,
        mmproj=mmproj_for(options.mmproj, [model] if refs is None else refs).get(model),
        ep=options.ep if first else None,
    )


def engine_config(options: EngineOptions, model: str | None, paths, refs: list[str | None] | None = None, first: bool = True, **fields):
    """The `EngineConfig` of `model`: the options (`engine_fields`), then what the command sets
    besides (`fields`: serve's sequences and caches), then the model's own settings in
    config.toml where neither set one (gpu_layers, chat_template, mmproj)."""
    from edgechat.engine import EngineConfig
    from edgechat.models.settings import with_model_settings

    return with_model_settings(EngineConfig(model=model, paths=paths, **{**engine_fields(options, model, paths, refs, first), **fields}))
