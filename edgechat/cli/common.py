"""Options shared by several commands, defined once, and the one place user errors become a line."""

from __future__ import annotations

import math
import sys

import click

from edgechat.engine.types.request import DEFAULT_MAX_TOKENS
from edgechat.errors import EdgechatError
from edgechat.params import FlashAttn, KVType, SpeculativeMode, SwaCache, values

data_dir_option = click.option(
    "--data-dir",
    envvar="EDGECHAT_DATA_DIR",
    default=None,
    type=click.Path(file_okay=False),
    help="Keep conversations, snapshots and caches under this directory (env: EDGECHAT_DATA_DIR).",
)

flash_attn_option = click.option(
    "--flash-attn",
    type=click.Choice(values(FlashAttn)),
    default="auto",
    help="llama.cpp flash attention (off can be faster deep into long chats on CPUs).",
)

swa_cache_option = click.option(
    "--swa-cache",
    type=click.Choice(values(SwaCache)),
    default="auto",
    help="Sliding-window models (Gemma 3): small keeps only the window of the sliding layers (3-5x less KV "
    "memory; conversations then truncate instead of shifting); auto uses it where the full cache does not fit.",
)


draft_model_option = click.option(
    "--draft-model",
    default=None,
    metavar="MODEL",
    help="A smaller model of the same family (same tokenizer) that guesses tokens for the model to check, "
    "e.g. a Q4 of the same model drafting for its Q8_0 or F16 (default: the catalog entry's draft, if any).",
)


kv_type_option = click.option("--kv-type", type=click.Choice(values(KVType)), default=KVType.F16.value, show_default=True,
                              help="KV cache element type (q8_0: half f16's memory).")


def speculative_option(command):
    """--speculative and --draft-model: the two go together."""
    command = draft_model_option(command)
    return click.option(
        "--speculative",
        type=click.Choice(values(SpeculativeMode)),
        default="auto",
        help="Speculative decoding (same output, fewer model passes): auto guesses from the text so far and with "
        "the draft model, where that pays; lookup always guesses from the text; draft always asks the draft "
        "model; off never guesses.",
    )(command)


#: what --seed promises, and what it does not without --deterministic
SEED_HELP = ("Sampling seed. With --deterministic, the same seed, prompt and settings give the same text on the same "
             "machine and build; otherwise the text can differ where two tokens nearly tie, because other requests, "
             "cached prompts and speculative decoding change llama.cpp's batch shapes, and with them its rounding.")

deterministic_option = click.option(
    "--deterministic/--no-deterministic",
    default=None,
    help="The same text for the same seed, prompt and settings, whatever else runs or is cached: one request at "
    "a time, every prompt prefilled afresh, no prompt cache, no speculative decoding (slower; see the README). "
    "Default: deterministic under [engine] in config.toml, else off.",
)


def deterministic_setting(flag: bool | None, paths) -> bool:
    """--deterministic, else `[engine] deterministic` in config.toml, else off."""
    from edgechat.config import load_settings
    from edgechat.errors import UsageError

    if flag is not None:
        return flag
    value = (load_settings(paths).get("engine") or {}).get("deterministic", False)
    if not isinstance(value, bool):
        raise UsageError(f"{paths.config_file}: [engine] deterministic must be true or false; fix or remove that line")
    return value


def _gpu_layers(ctx, param, value):
    if value is None:
        return None
    from edgechat.errors import UsageError
    from edgechat.models.planner import parse_gpu_layers

    try:
        return parse_gpu_layers(value)
    except UsageError:
        raise click.BadParameter(f"use auto, all or a number of layers, not '{value}'") from None


gpu_layers_option = click.option(
    "--gpu-layers",
    default=None,
    metavar="auto|N|all",
    callback=_gpu_layers,
    help="Layers on the GPU: auto (as many as its free memory holds with the context's KV cache), all, or N "
    "(default: the model's gpu_layers in config.toml, else auto). No effect on a CPU-only build.",
)


def _rpc(ctx, param, value):
    from edgechat.engine.runners.devices import parse_rpc
    from edgechat.errors import UsageError

    try:
        return parse_rpc(value)
    except UsageError:
        raise click.BadParameter(f"use host:port[,host:port...], not '{value}'") from None


rpc_option = click.option(
    "--rpc",
    default=None,
    metavar="HOST:PORT,...",
    callback=_rpc,
    help="llama.cpp RPC servers (ggml-rpc-server) whose CPUs or GPUs take layers like local GPUs; needs a "
    "llama.cpp built with -DGGML_RPC=ON (packaging/GPU.md).",
)


chat_template_option = click.option(
    "--chat-template",
    default=None,
    metavar="FILE",
    help="A Jinja chat template to use instead of the model's own (for a GGUF whose template is missing or "
    "wrong; per model: chat_template = \"FILE\" under [models.\"NAME\"] in config.toml).",
)


def _mmproj(ctx, param, value: tuple[str, ...]) -> dict[str | None, str]:
    """--mmproj FILE / MODEL=FILE, repeatable -> {MODEL (None for a plain FILE): FILE}, every
    file checked now to be a projector's GGUF."""
    from pathlib import Path

    from edgechat.errors import EdgechatError
    from edgechat.models.ggufinfo import read_projector_info

    chosen: dict[str | None, str] = {}
    for item in value:
        model, sep, file = item.partition("=")
        name: str | None = model.strip()
        if not sep or not name or Path(item).expanduser().is_file():  # a file whose name holds '='
            name, file = None, item
        if name in chosen:
            raise click.BadParameter("give one FILE (for the first model) or MODEL=FILE for each model"
                                     if name is None else f"{name} is given two projectors")
        try:
            read_projector_info(Path(file).expanduser())
        except EdgechatError as exc:
            raise click.BadParameter(str(exc)) from None
        chosen[name] = str(Path(file).expanduser())
    return chosen


#: `--mmproj FILE` for the model (the first one, where a command takes several), `MODEL=FILE`
#: for another; give the value to mmproj_for with the command's models
mmproj_option = click.option(
    "--mmproj",
    multiple=True,
    metavar="FILE|MODEL=FILE",
    callback=_mmproj,
    help="The model's vision projector (its mmproj GGUF), where none is beside the model file or was pulled with it; "
    "with several models, MODEL=FILE for each (per model: mmproj = \"FILE\" under [models.\"NAME\"] in config.toml).",
)


def mmproj_for(chosen: dict[str | None, str], refs: list[str | None]) -> dict[str | None, str]:
    """Which of `refs` (the models as given with -m, None for the default one) each --mmproj
    value goes to: a plain FILE to the first, MODEL=FILE to the one typed as MODEL (or whose
    file's name is MODEL); a one-line error for a MODEL not among them."""
    from pathlib import Path

    from edgechat.errors import UsageError
    from edgechat.models import DEFAULT_MODEL

    out: dict[str | None, str] = {}
    for name, file in chosen.items():
        if name is None:
            matches = refs[:1] or [None]
        else:
            matches = [r for r in refs if name in (r or DEFAULT_MODEL, Path(r or DEFAULT_MODEL).stem)]
        if not matches:
            given = ", ".join(r or DEFAULT_MODEL for r in refs)
            raise UsageError(f"--mmproj {name}=FILE: {name} is not a model given here ({given}); name one of those")
        if matches[0] in out:
            raise UsageError(f"--mmproj: {matches[0] or DEFAULT_MODEL} is given two projectors; give it one")
        out[matches[0]] = file
    return out


def gpu_layers_note(value, rpc: list[str] | None = None) -> None:
    """One line, never a failure, when --gpu-layers is given to a llama.cpp that cannot offload."""
    from edgechat.engine.runners import devices

    if value is not None and not rpc and not devices.gpu_devices():
        click.echo("edgechat: note: this llama.cpp is a CPU-only build, so --gpu-layers has no effect "
                   "(GPU builds: packaging/GPU.md)", err=True)


def model_option(func=None, *, many: bool = False):
    """-m/--model: the model a command loads (with many=True, -m may be given several times:
    `serve`'s models); its engine's options are cli/engine_options.py's."""
    if func is None:
        return lambda f: model_option(f, many=many)
    if many:
        return click.option("-m", "--model", "models", multiple=True, metavar="MODEL",
                            help="Model: short name, path to a .gguf, or Hub reference; repeat it to serve several "
                                 "(the first answers requests that name none).")(func)
    return click.option("-m", "--model", default=None, help="Model: short name, path to a .gguf, or Hub reference.")(func)


class _FiniteRange(click.FloatRange):
    """click's FloatRange lets nan through (every comparison with it is false)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        return number


def _sampling_option(name: str):
    """--NAME with the range of the engine's one table of sampling limits."""
    from edgechat.params import SAMPLING_LIMITS

    limit = SAMPLING_LIMITS[name]
    if limit.kind is int:
        kind = click.IntRange(int(limit.lo), None if limit.hi is None else int(limit.hi), min_open=limit.lo_open)
    else:
        kind = _FiniteRange(limit.lo, limit.hi, min_open=limit.lo_open)
    return click.option(f"--{name.replace('_', '-')}", type=kind, default=None,
                        help=f"{limit.meaning[0].upper()}{limit.meaning[1:]} ({limit.off}).")


def sampling_options(func):
    """The sampling knobs every generating command accepts."""
    opts = [
        *(_sampling_option(name) for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")),
        click.option("--seed", type=int, default=None, help=SEED_HELP),
        click.option("--max-tokens", type=click.IntRange(min=1), default=None,
                     help=f"Most tokens in the answer (default: {DEFAULT_MAX_TOKENS}; an answer cut there ends with "
                     "finish_reason length)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-text (benchmarks; no loop guard)."),
        click.option("--no-loop-guard", "loop_guard", flag_value=False, default=True,
                     help="Let an answer that only repeats itself go on (by default it is stopped, finish_reason length)."),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


def fail(message: str, code: int = 1) -> None:
    click.echo(f"edgechat: error: {message}", err=True)
    sys.exit(code)


def run_guarded(group: click.Group, args: list[str]) -> None:
    """Run the CLI; EdgechatError and Ctrl+C become one line and an exit status, never a traceback."""
    try:
        group.main(args=args, prog_name="edgechat", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("\nedgechat: interrupted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx else "edgechat"
        fail(f"{exc.format_message()} (see: {where} --help)", exc.exit_code)
    except click.ClickException as exc:
        fail(exc.format_message(), exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except EdgechatError as exc:
        fail(str(exc), exc.exit_code)
    except BrokenPipeError:
        sys.exit(0)
