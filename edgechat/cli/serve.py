"""`edgechat serve`: the OpenAI-compatible server on one model or several, each loaded when a
request asks for it and unloaded when idle (engine/pool.py)."""

from __future__ import annotations

import ipaddress
import logging
import signal
from pathlib import Path

import click

from edgechat.cli.common import data_dir_option, gpu_layers_note, model_option
from edgechat.cli.engine_options import EngineOptions, engine_config, engine_options
from edgechat.engine.speech.models import speech_models
from edgechat.errors import UsageError
from edgechat.server.settings import ServerSettings


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cors_origins(ctx, param, value: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    origins = tuple(o.strip().rstrip("/") for o in value.split(","))
    if not all(origins) or any(o != "*" and "://" not in o for o in origins):
        raise click.BadParameter(f"use * or origins such as http://localhost:5173 separated by commas, not {value!r}")
    return origins


def _aliases(ctx, param, value: tuple[str, ...]) -> tuple[str, ...]:
    if any(not a.strip() for a in value):
        raise click.BadParameter("an alias must not be empty")
    return tuple(a.strip() for a in value)


def _stop_on_sigterm(signum, frame) -> None:
    # uvicorn stops gracefully on SIGTERM, then raises it again under the handler it found: this
    # one ends the command through its `finally`, which closes the pool (conversations' snapshots
    # and prompt states written), where the default handler would end the process first
    raise SystemExit(0)


def _model_id(ref: str) -> str | None:
    """A short name is the friendliest id; for a path or Hub reference, the file's name (None)."""
    return None if ref.endswith(".gguf") or "/" in ref else ref


def _models_dir(ctx, param, value: str | None) -> list[str]:
    """The GGUF files of --models-dir (a split model by its first part), by name."""
    if value is None:
        return []
    from edgechat.models.ggufinfo import split_part_names

    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise click.BadParameter(f"{value} is not a folder")
    files = sorted(str(p) for p in folder.glob("*.gguf") if split_part_names(p.name)[0] == p.name)
    if not files:
        raise click.BadParameter(f"{value} holds no .gguf file")
    return files


@click.command("serve")
@model_option(many=True)
@engine_options(many=True)
@click.option("--models-dir", type=click.Path(file_okay=False), default=None, callback=_models_dir,
              help="Serve every .gguf in this folder too (each by its file's name), loaded when first asked for.")
@click.option("--memory-budget", type=click.IntRange(min=1), default=None, metavar="MIB",
              help="Memory (MiB) the loaded models may take together, as the planner counts them (weights, KV cache, "
                   "compute; the loaded speech models too); idle models are unloaded to make room (default: what the OS has available).")
@click.option("--idle-unload", type=click.FloatRange(min=0.0), default=None, metavar="SECONDS",
              help="Unload a model after this many seconds without requests (per model: idle_unload in config.toml; "
                   "per request: keep_alive; the speech models alike). Default: keep it until the room is needed.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on, or several separated by commas (127.0.0.1,::1); anything but loopback exposes the model to your network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--parallel", type=click.IntRange(1, 256), default=4, show_default=True, help="Sequences generated at once (continuous batching).")
@click.option(
    "--cache-ram",
    type=click.IntRange(min=0),
    default=256,
    show_default=True,
    metavar="MIB",
    help="Host RAM (MiB) for the KV states of recent prompts beyond the sequences; a re-sent prefix is restored, not prefilled. 0 = off.",
)
@click.option(
    "--cache-disk",
    type=click.IntRange(min=0),
    default=1024,
    show_default=True,
    metavar="MIB",
    help="Disk (MiB) for the prompt cache's states, so they outlive a restart or an unload (written while serving "
         "and at shutdown; least recently used out first). 0 = off.",
)
@click.option("--api-key", default=None, envvar="EDGECHAT_API_KEY", help="Require 'Authorization: Bearer KEY' on every endpoint but /health (env: EDGECHAT_API_KEY).")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=None, metavar="TOKENS",
              help="Prompt tokens read per step while other answers stream (chunked prefill): smaller keeps their pace "
                   "steadier while a long prompt arrives, larger reads it sooner (default: one llama.cpp ubatch, 512).")
@click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True, help="Requests that may wait for a sequence; more get 429.")
@click.option("--max-input-tokens", type=click.IntRange(min=1), default=None, help="Longer prompts get 400 (default: what the context holds).")
@click.option("--max-messages", type=click.IntRange(min=1), default=ServerSettings.max_messages, show_default=True, help="Chat requests with more messages get 400 before any templating.")
@click.option("--memory-floor", type=click.IntRange(min=0), default=None, metavar="MIB",
              help="Free memory below which the server sheds: the prompt cache's RAM, idle models, then new requests (503, Retry-After); "
                   "default: 10% of the memory it may use (its cgroup's limit, else RAM), at least 256; 0: never.")
@click.option("--timeout", "request_timeout", type=click.FloatRange(min=1.0), default=600.0, show_default=True, help="Seconds before a request is cancelled.")
@click.option("--degrade-queue-wait", type=click.FloatRange(min=0.0), default=10.0, show_default=True, help="Queue wait (s) that turns on the degrade switch (max_tokens cap, --fallback-model); 0 disables.")
@click.option("--degrade-max-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="The max_tokens cap while degraded.")
@click.option("--fallback-model", default=None, help="A smaller model that serves new requests while degraded.")
@click.option("--embedding-model", default=None, help="A GGUF that computes /v1/embeddings and /api/embed (default: the model itself, mean-pooled where its file names no pooling).")
@click.option("--priority-class", "priority_classes", multiple=True, metavar="NAME=SHARE[:QUEUE]", help="A priority class with its own share of the --parallel sequences and its own queue (repeatable); requests pick one by API key or X-Priority.")
@click.option("--key-class", "key_classes", multiple=True, metavar="KEY=CLASS", help="An API key (accepted besides --api-key) whose requests are in CLASS (repeatable).")
@click.option("--failover-after", type=click.FloatRange(min=0.0), default=None, help="Seconds without a first token after which a request moves to --fallback-model (X-Failover-After per request).")
@click.option("--cors-origins", default=None, metavar="ORIGINS", callback=_cors_origins,
              help="Origins whose web pages may call the API, separated by commas (http://localhost:5173), or * for any; default: none.")
@click.option("--alias", "aliases", multiple=True, callback=_aliases, metavar="NAME",
              help="Another name the model answers to in every API and /v1/models lists (repeatable).")
@click.option("--any-model-name", is_flag=True, help="Serve requests naming any unknown model with this one (clients that hard-code a model name).")
@click.option("--image-dir", type=click.Path(exists=True, file_okay=False), default=None, metavar="FOLDER",
              help="A folder whose images requests may name as file:// URLs (default: none; data URLs always work).")
@click.option("--max-image-mib", type=click.FloatRange(min=0.0, min_open=True), default=ServerSettings.max_image_bytes / 2**20,
              show_default=True, help="The largest image file a request may send (MiB); larger ones get 400.")
@click.option("--max-image-megapixels", type=click.FloatRange(min=0.0, min_open=True), default=ServerSettings.max_image_megapixels,
              show_default=True, help="The most pixels an image may have (millions, from its header); more get 400.")
@click.option("--max-images", type=click.IntRange(min=1), default=ServerSettings.max_images, show_default=True,
              help="The most images one request may hold; more get 400.")
@click.option("--stt-model", default=None, metavar="MODEL",
              help="Speech to text for /v1/audio/transcriptions: a faster-whisper folder, a Hub repo, or whisper-base (needs edgechat[voice]).")
@click.option("--tts-model", default=None, metavar="VOICE",
              help="Text to speech for /v1/audio/speech: a Piper voice's .onnx or its name, en_US-lessac-medium (needs edgechat[voice]).")
@click.option("--reasoning-budget", type=click.IntRange(min=-1), default=-1, show_default=True,
              help="Reasoning models: the most tokens a request may think when it names no budget (-1: no limit, 0: no thinking).")
@click.option("--reasoning-format", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
              help="auto: thoughts apart in reasoning_content; none: left in the content as the model wrote them.")
@data_dir_option
def serve_cmd(
    models: tuple[str, ...],
    models_dir: list[str],
    options: EngineOptions,
    memory_budget: int | None,
    idle_unload: float | None,
    host: str,
    port: int,
    parallel: int,
    cache_ram: int,
    cache_disk: int,
    reasoning_budget: int,
    reasoning_format: str,
    api_key: str | None,
    max_queue: int,
    prefill_chunk: int | None,
    max_input_tokens: int | None,
    max_messages: int,
    request_timeout: float,
    degrade_queue_wait: float,
    degrade_max_tokens: int,
    fallback_model: str | None,
    embedding_model: str | None,
    priority_classes: tuple[str, ...],
    key_classes: tuple[str, ...],
    failover_after: float | None,
    cors_origins: tuple[str, ...],
    aliases: tuple[str, ...],
    any_model_name: bool,
    image_dir: str | None,
    max_image_mib: float,
    max_image_megapixels: float,
    max_images: int,
    stt_model: str | None,
    tts_model: str | None,
    memory_floor: int | None,
    data_dir: str | None,
) -> None:
    """Serve models over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /metrics),
    Anthropic's, Ollama's and llama-server's. With several -m, each loads when a request names it."""
    from edgechat import sysmem
    from edgechat.config import get_paths
    from edgechat.engine import EngineConfig
    from edgechat.engine.pool import ModelPool
    from edgechat.models import DEFAULT_MODEL, planner
    from edgechat.models.settings import own_settings
    from edgechat.server import create_app, listen
    from edgechat.server.memoryguard import default_floor
    from edgechat.server.priority import parse_class

    gpu_layers_note(options.gpu_layers, options.rpc)
    paths = get_paths(data_dir)
    speech = speech_models(stt_model, tts_model, paths, options.threads, idle_unload)
    classes = tuple(parse_class(c) for c in priority_classes)
    keys = dict(k.rpartition("=")[::2] for k in key_classes)
    unknown = sorted({c for c in keys.values() if c not in {k.name for k in classes}} | {"" for k in keys if not k})
    if unknown:
        raise UsageError(f"--key-class wants KEY=CLASS with CLASS one of the --priority-class names; got {', '.join(repr(u) for u in unknown)}")
    hosts = listen.parse_hosts(host)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    log = logging.getLogger("edgechat.server")
    refs = list(models or ([] if models_dir else [DEFAULT_MODEL])) + models_dir
    every = [*refs, *([fallback_model] if fallback_model else [])]
    # before the model loads: an address that cannot be had fails at once
    sockets = listen.bind(hosts, port)
    for h in hosts:
        if not _is_loopback(h):
            log.warning("listening on %s: other machines can reach this server%s", h, "" if api_key else " and it has no --api-key")

    def own(name: str, key: str, default, kind=int, least=1):
        """A model's own setting from config.toml's [models."NAME"] table, checked."""
        value = own_settings(paths, name).get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (kind, int)) or value < least):
            raise UsageError(f"{key} for {name} in {paths.config_file} must be a number of at least {least}, not {value!r}")
        return value

    def config(name: str, first: bool = False) -> EngineConfig:
        # the draft, embedding, template and execution provider options are the first model's
        return engine_config(
            options, name, paths, every, first,
            n_ctx=own(name, "ctx", options.ctx, least=64),
            ctx_cap=None,  # agents' prompts are 10-20k tokens: the trained window where memory allows
            n_parallel=own(name, "parallel", parallel),
            prompt_cache_budget=cache_ram << 20,
            prompt_cache_disk=cache_disk << 20,
            embedding_model=embedding_model if first else None,
            max_queue=max_queue,
            **({"prefill_chunk": prefill_chunk} if prefill_chunk else {}),
        )

    pool = ModelPool(memory_budget << 20 if memory_budget is not None else None, held_elsewhere=speech.held_bytes)
    fallback = None
    sigterm = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        for i, ref in enumerate(refs):
            pool.add(_model_id(ref), config(ref, first=i == 0), own(ref, "idle_unload", idle_unload, float, 0))
        first = next(iter(pool.models))
        if fallback_model:
            # a pool model like the others: loaded when degraded requests first need it
            fallback = pool.add(_model_id(fallback_model), config(fallback_model)).name
            log.info("degraded requests go to %s", fallback)
        # the first model loads now: a file that cannot load fails here, and the first answer is quick
        engine = pool.acquire(first)
        pool.release(first)
        if engine.template_mode != "chat":
            log.warning("%s has no usable chat template: chat messages are joined as plain text", engine.model_name)
        floor = memory_floor << 20 if memory_floor is not None else default_floor(sysmem.read(), planner.total_memory())
        if floor:
            log.info("memory floor: %d MiB free (below it the server sheds; --memory-floor)", floor >> 20)
        settings = ServerSettings(
            api_key=api_key,
            max_input_tokens=max_input_tokens,
            max_messages=max_messages,
            request_timeout=request_timeout,
            degrade_queue_wait=degrade_queue_wait or None,
            degrade_max_tokens=degrade_max_tokens,
            priority_classes=classes,
            key_classes=keys,
            failover_after=failover_after,
            reasoning_budget=None if reasoning_budget == -1 else reasoning_budget,
            reasoning_format=reasoning_format,
            aliases=aliases,
            any_model_name=any_model_name,
            cors_origins=cors_origins,
            image_dir=Path(image_dir).expanduser().resolve() if image_dir else None,
            max_image_bytes=int(max_image_mib * 2**20),
            max_image_megapixels=max_image_megapixels,
            max_images=max_images,
            memory_floor=floor,
        )
        urls = ", ".join(f"http://{listen.url_host(h)}:{s.getsockname()[1]}/v1" for h, s in zip(hosts, sockets, strict=False))
        others = f" (and {', '.join(list(pool.models)[1:])}, loaded when asked)" if len(pool.models) > 1 else ""
        reads = f" (reads {' and '.join(engine.modalities)})" if engine.modalities else ""
        log.info("serving %s%s%s: %d sequences of %d tokens on %s", engine.model_name, reads, others, engine.config.n_parallel,
                 engine.n_ctx, urls)
        del engine  # the pool's to unload: nothing else may hold it
        listen.serve(create_app(settings, fallback=fallback, pool=pool, speech=speech), sockets)
    finally:
        for sock in sockets:
            sock.close()
        pool.close()
        signal.signal(signal.SIGTERM, sigterm)


def register(cli: click.Group) -> None:
    cli.add_command(serve_cmd)
