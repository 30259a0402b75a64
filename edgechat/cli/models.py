"""`edgechat models` (and `models rm`), `edgechat ps` and `edgechat doctor`: what can run here, what a
running server has loaded, and how this machine is set up."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import click

from edgechat.cli.common import data_dir_option, rpc_option
from edgechat.config import get_paths
from edgechat.engine.output.reasoning import reasoning_format
from edgechat.errors import EdgechatError, UsageError
from edgechat.models import known_model_names, planner, resolve_model
from edgechat.models.catalog import catalog_row, format_size, load_catalog
from edgechat.models.ggufinfo import read_projector_info
from edgechat.models.hub import is_downloaded
from edgechat.models.onnxinfo import is_onnx_folder, read_info
from edgechat.params import KVType


def _model_rows(paths, kv_type: KVType = KVType.F16, names: list[str] | None = None) -> list[dict]:
    from edgechat.engine.runners import devices
    from edgechat.models.settings import own_settings, projector_for

    gpus = devices.gpu_devices()
    rows = []
    for name in names or known_model_names(paths):
        try:
            path = resolve_model(name, paths)
            info = read_info(path)
            own = own_settings(paths, name)
            projector = projector_for(paths, name, path, own)  # what `edgechat run -m NAME` would load
            reads = read_projector_info(projector).modalities if projector else ()
        except EdgechatError as exc:
            rows.append({"name": name, "error": str(exc)})
            continue
        projector_bytes = planner.projector_bytes(projector)
        fits = planner.max_context_that_fits(info, kv_type, projector=projector_bytes)
        if is_onnx_folder(path):
            device = "onnxruntime (--ep)"
        else:
            # the split `edgechat run -m NAME` would use: the model's gpu_layers setting (else
            # auto) at the default context
            plan = planner.plan_for(info, min(max(info.context_length, planner.MIN_CTX), planner.DEFAULT_CTX_CAP), 1, kv_type,
                                    projector=projector_bytes)
            device = planner.gpu_split(info, plan, own.get("gpu_layers"), gpus).describe()
        rows.append(
            {
                "name": name,
                "size": format_size(info.size_bytes),
                "quant": info.quant,
                # a reasoning model says so: its template opens a thinking block (run --think);
                # a model with a projector, what it reads besides text
                "arch": ", ".join([info.architecture, *(["thinks"] if reasoning_format(info.chat_template) else []), *reads]),
                "trained_ctx": info.context_length,
                # as the planner counts it: every layer, sliding ones included (full SWA cache)
                "kv_per_token": info.kv_cache_bytes(1, planner.kv_bytes(info, kv_type), swa_full=True),
                "kv_per_token_q8": info.kv_cache_bytes(1, planner.kv_bytes(info, KVType.Q8_0), swa_full=True),
                "fits_ctx": fits,
                "device": device,
            }
        )
    return rows


#: where `ps` and `models rm` look for a running server
DEFAULT_URL = "http://127.0.0.1:8000"

#: what a fitted table keeps for its last column (a description) before it drops other columns
LAST_ROOM = 40


def _table(headers: list[str], rows: list[list[str]], drop: tuple[str, ...] = ()) -> str:
    """Columns padded to their widest cell, fitted to the terminal: the columns named in `drop`
    go first (in that order) until the last column has room for LAST_ROOM characters of its
    text, which is then cut with an ellipsis. Piped output (no terminal width known) keeps every
    column whole."""
    limit = shutil.get_terminal_size((0, 0)).columns
    full = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    keep = list(range(len(headers)))
    room = lambda: limit - sum(full[i] for i in keep[:-1]) - 2 * (len(keep) - 1)  # noqa: E731
    for name in drop:
        if not limit or room() >= min(full[-1], LAST_ROOM):
            break
        keep.remove(headers.index(name))
    widths = [full[i] for i in keep]
    if limit and room() < full[-1] and room() >= 8:
        widths[-1] = room()

    def line(cells: list[str]) -> str:
        cells = [cells[i] for i in keep]
        if len(cells[-1]) > widths[-1]:
            cells[-1] = cells[-1][: widths[-1] - 1] + "…"
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in full])] + [line(r) for r in rows])


def _catalog_table(paths) -> str:
    rows = []
    for e in load_catalog().values():
        quants = ", ".join([f"{q} {format_size(f.size)}" for q, f in e.files.items()]
                           + ([f"vision projector {format_size(e.mmproj.size)}"] if e.mmproj else []))
        have = ", ".join(q for q, f in e.files.items() if is_downloaded(e, f, paths)) or "-"
        rows.append([e.name, "yes" if e.thinks else "-", quants, have, e.licence, str(e.context), e.repo, e.description])
    return _table(["NAME", "THINKS", "QUANTS (about)", "DOWNLOADED", "LICENCE", "TRAINED CTX", "HUB REPO", "DESCRIPTION"], rows,
                  drop=("HUB REPO", "LICENCE", "TRAINED CTX", "QUANTS (about)", "THINKS"))


class _ModelsGroup(click.Group):
    """`edgechat models [MODEL]...` lists (its `list` command); `edgechat models rm NAME` removes."""

    def parse_args(self, ctx, args):
        if not (args[:1] and (args[0] in self.commands or args[0] in ("-h", "--help"))):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@click.group("models", cls=_ModelsGroup)
def models_cmd():
    """List the models available offline (`edgechat models [MODEL]...`), or remove one from the
    cache (`edgechat models rm NAME`)."""


@models_cmd.command("list")
@click.argument("refs", nargs=-1, metavar="[MODEL]...")
@click.option("--catalog", "show_catalog", is_flag=True, help="Show the curated catalog: quants, sizes, licences, Hub repos.")
@rpc_option
@data_dir_option
def models_list(refs, show_catalog, rpc, data_dir):
    """List the models available offline: size, quant, architecture, and whether they fit.
    Catalog models not downloaded yet are listed too; `edgechat pull NAME` fetches one.
    Given MODELs (names, .gguf files, ONNX folders), list just those."""
    paths = get_paths(data_dir)
    if rpc:
        from edgechat.engine.runners import devices

        devices.add_rpc_servers(rpc)  # their devices take layers: the split below counts them
    if show_catalog:
        click.echo(_catalog_table(paths))
        return
    rows = []
    for r in _model_rows(paths, names=list(refs)):
        if "error" in r:
            rows.append([r["name"], "-", "-", "-", "-", r["error"], "-"])
        else:
            fit = f"yes, up to {r['fits_ctx']} ctx" if r["fits_ctx"] else "no"
            rows.append([r["name"], r["size"], r["quant"], r["arch"], str(r["trained_ctx"]), fit, r["device"]])
    listed = {row[0] for row in rows}
    for e in [] if refs else load_catalog().values():
        if e.name not in listed:
            row = catalog_row(e)
            arch = ", ".join([row.architecture, *(["thinks"] if e.thinks else []), *(["vision"] if e.mmproj else [])])
            rows.append([row.name, row.size, row.quant, arch, str(row.context), row.fit_text, "-"])
    click.echo(_table(["NAME", "SIZE", "QUANT", "ARCH", "TRAINED CTX", "FITS HERE", "LAYERS ON"], rows))
    if len(rows) > len(listed):
        click.echo("\nnot downloaded: `edgechat pull NAME` once (or first use online fetches it); details: edgechat models --catalog")


def _cached_files(name: str, paths) -> list[Path]:
    """The files (or ONNX folder) that hold `name` in edgechat's cache, every part of a split
    model; a one-line UsageError for a model that is not there."""
    from edgechat.models import catalog, hub
    from edgechat.models.embedded import ALIASES, EMBEDDED
    from edgechat.models.ggufinfo import split_part_names

    if ALIASES.get(name.lower(), name.lower()) in EMBEDDED:
        raise UsageError(f"{name} is embedded in edgechat (it ships with the app): there is nothing to remove")
    cache = paths.models_cache
    gguf = cache / f"{name}.gguf"
    if gguf.is_file():
        return [p for p in (cache / part for part in split_part_names(gguf.name)) if p.exists()]
    if is_onnx_folder(cache / name):
        return [cache / name]
    found = catalog.lookup(name)
    ref = hub.HubRef(found[0].repo, found[1].file, found[1].quant, name) if found else hub.parse_hub_ref(name)
    if ref is None:
        raise UsageError(f"{name} is not a model in edgechat's cache ({cache}); see: edgechat models")
    path = hub.cached(ref, paths)
    if path is None:
        raise UsageError(f"{name} is not downloaded: there is nothing to remove (see: edgechat models)")
    # the Hub cache's file is a link to its blob: both go
    links = [path.parent / part for part in split_part_names(path.name)]
    # a vision projector serves every quant of its repo: it goes with the last of them
    projector = hub.cached_projector(name, paths)
    others = [snapshot / n for snapshot, names in hub.cached_revisions(ref.repo, paths) for n in names
              if not hub.is_projector_name(n) and snapshot / n not in links]
    if projector is not None and not others:
        links.append(projector)
    return [p for link in links for p in (link, link.resolve()) if p.exists() or p.is_symlink()]


def _refuse_if_loaded(name: str, files: list[Path], url: str, api_key: str | None) -> None:
    """A running server that has the model loaded keeps it: refuse (where no server answers,
    nothing here can have it loaded)."""
    try:
        cards = server_models(url, api_key, timeout=3.0)
    except EdgechatError as exc:
        if "API key" in str(exc):
            raise UsageError(f"cannot tell whether the server at {url} has {name} loaded: pass its --api-key") from None
        return
    ours = {f.resolve() for f in files}
    for card in cards:
        meta = card.get("meta") or {}
        if meta.get("state", "loaded") in ("loaded", "loading") and meta.get("path") and Path(meta["path"]).resolve() in ours:
            raise UsageError(f"{name} is loaded by the server at {url} (as '{card['id']}'); unload it first "
                             "(a request with keep_alive 0) or stop that server")


@models_cmd.command("rm")
@click.argument("name")
@click.option("-y", "--yes", is_flag=True, help="Remove without asking.")
@click.option("--url", default=DEFAULT_URL, show_default=True, help="A running server to ask whether the model is loaded.")
@click.option("--api-key", default=None, envvar="EDGECHAT_API_KEY", help="That server's API key (env: EDGECHAT_API_KEY).")
@data_dir_option
def models_rm(name: str, yes: bool, url: str, api_key: str | None, data_dir: str | None) -> None:
    """Remove a downloaded model's files from edgechat's cache, and nothing else (not a .gguf
    elsewhere, not conversations); refused while a running server has it loaded."""
    paths = get_paths(data_dir)
    files = _cached_files(name, paths)
    _refuse_if_loaded(name, files, url, api_key)
    size = sum(_size(f) for f in files)
    if not yes:
        click.confirm(f"remove {name} ({format_size(size)}: {', '.join(f.name for f in files)}) from {paths.models_cache}?", abort=True)
    for f in files:
        if f.is_dir() and not f.is_symlink():
            shutil.rmtree(f)
        else:
            f.unlink(missing_ok=True)
    click.echo(f"removed {name} ({format_size(size)})")


def _size(path: Path) -> int:
    if path.is_symlink():
        return 0  # its blob is counted
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


@click.command("doctor")
@click.option("--expect", "expect", default=None, metavar="BACKEND",
              help="Fail unless this llama.cpp has BACKEND (CUDA, Metal, Vulkan, OpenCL, RPC...): checks a GPU install.")
@rpc_option
@data_dir_option
def doctor_cmd(expect, rpc, data_dir):
    """Report this machine, the llama.cpp build, edgechat's paths and which models fit."""
    from edgechat import __version__
    from edgechat.android import on_android
    from edgechat.android import report as android_report
    from edgechat.engine.runners import devices, llamacpp
    from quantize import cpuprobe

    paths = get_paths(data_dir)
    features = llamacpp.system_info()
    if rpc:
        devices.add_rpc_servers(rpc)
    click.echo(f"edgechat {__version__} on {platform.system()} {platform.release()} ({platform.machine()}), Python {platform.python_version()}")
    if on_android():
        for line in android_report():
            click.echo(line)
    click.echo(f"CPU: {platform.processor() or platform.machine()}; {planner.physical_cores()} physical cores, "
               f"{os.cpu_count()} logical; edgechat uses {planner.default_threads()} threads by default")
    click.echo(f"CPU features (llama.cpp): {features.strip()}")
    extra, why = cpuprobe.verdict()
    click.echo(f"CPU weight layouts: {'repacked (extra buffer types)' if extra else 'plain'}: {why}")
    click.echo(f"RAM: {format_size(planner.total_memory())} total, {format_size(planner.available_memory())} available"
               f"; plans use {planner.headroom():.0%} of what is available")
    built = devices.backends()
    gpu = "yes" if llamacpp.supports_gpu_offload() else "no (CPU build; see packaging/GPU.md for CUDA, Metal, Vulkan)"
    click.echo(f"llama.cpp: llama-cpp-python {llamacpp.llama_version()}; backends: {', '.join(built)}; GPU offload: {gpu}")
    for dev in devices.devices():
        if dev.kind != "cpu":
            click.echo(f"  device {dev.name} ({dev.kind}, {dev.description}): {format_size(dev.free)} free of {format_size(dev.total)}")
    from edgechat.engine.runners.onnxrt import runtime_report
    from edgechat.engine.speech import voice_report

    click.echo(runtime_report())
    click.echo(voice_report())
    if expect and expect.lower() not in (b.lower() for b in built):
        raise UsageError(f"this llama.cpp has no {expect} backend (it has {', '.join(built)}); "
                         "reinstall llama-cpp-python with the CMAKE_ARGS in packaging/GPU.md")
    click.echo(f"Paths: data {paths.data}\n       cache {paths.cache}\n       config {paths.config_file}")
    click.echo("")
    rows = []
    for r in _model_rows(paths):
        if "error" in r:
            rows.append([r["name"], "-", "-", "-", "-", "-", r["error"], "-"])
            continue
        rows.append([
            r["name"], r["size"], r["quant"], r["arch"], str(r["trained_ctx"]),
            f"{r['kv_per_token'] / 1024:.1f} KiB (q8_0: {r['kv_per_token_q8'] / 1024:.1f})",
            str(r["fits_ctx"]) if r["fits_ctx"] else "does not fit", r["device"],
        ])
    click.echo(_table(["MODEL", "SIZE", "QUANT", "ARCH", "TRAINED CTX", "KV/TOKEN (f16)", "CTX THAT FITS", "LAYERS ON"], rows))



def server_models(url: str, api_key: str | None, timeout: float = 10.0) -> list[dict]:
    """The /v1/models cards of the server at `url` (edgechat's: each with its state in meta)."""
    return server_get(url, api_key, "/v1/models", timeout).json()["data"]


def server_get(url: str, api_key: str | None, path: str, timeout: float = 10.0):
    """GET `path` of the server at `url`; one line where it does not answer as an OpenAI-compatible one."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base}{path}", headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise EdgechatError(f"no server answers at {base} ({type(exc).__name__}); start one with: edgechat serve, or pass --url") from None
    if r.status_code in (401, 403):
        raise EdgechatError(f"the server at {base} wants an API key: pass --api-key (or set EDGECHAT_API_KEY)")
    try:
        r.raise_for_status()
        if path == "/v1/models":
            r.json()["data"]
        return r
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        raise EdgechatError(f"{base} did not answer {path} as an OpenAI-compatible server does (HTTP {r.status_code})") from None


def _mib(n) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n else "-"


def _seconds(s) -> str:
    if s is None:
        return "-"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"


@click.command("ps")
@click.option("--url", default=DEFAULT_URL, show_default=True, help="The edgechat server to ask.")
@click.option("--api-key", default=None, envvar="EDGECHAT_API_KEY", help="Its API key, if it has one (env: EDGECHAT_API_KEY).")
def ps_cmd(url: str, api_key: str | None) -> None:
    """Show a running server's models: loaded or not, memory, context, requests running, idle time."""
    rows, seen = [], set()
    for card in server_models(url, api_key):
        meta = card.get("meta") or {}
        key = meta.get("path") or card["id"]
        if key in seen:  # an alias: the model is listed once, by its id
            continue
        seen.add(key)
        state = meta.get("state", "loaded")  # another server lists only what it serves
        loaded = state == "loaded"
        unloads = meta.get("unloads_in")
        rows.append([card["id"], state, _mib(meta.get("memory_bytes")), str(meta.get("n_ctx", "-")),
                     str(meta.get("running", 0)) if loaded else "-", _seconds(meta.get("idle_seconds")),
                     _seconds(unloads) if loaded and unloads is not None else "-"])
    click.echo(_table(["NAME", "STATE", "MEMORY", "CTX", "RUNNING", "IDLE", "UNLOADS IN"], rows))
    _ps_memory_and_tails(url, api_key)


#: /metrics histograms `ps` shows, as (column, histogram, unit)
_TAILS = (("PROMPT TOKENS", "edgechat_request_prompt_tokens", ""), ("OUTPUT TOKENS", "edgechat_request_output_tokens", ""),
          ("TTFT", "edgechat_time_to_first_token_seconds", "s"), ("TPOT", "edgechat_time_per_output_token_seconds", "s"),
          ("QUEUE", "edgechat_queue_wait_seconds", "s"))


def _ps_memory_and_tails(url: str, api_key: str | None) -> None:
    """The server's memory (/health) and its requests' p50/p95/p99 (/metrics); nothing from a
    server that has neither (another OpenAI-compatible one)."""
    from edgechat.scrape import histograms

    try:
        memory = server_get(url, api_key, "/health").json().get("memory")
        tails = histograms(server_get(url, api_key, "/metrics").text)
    except (EdgechatError, ValueError):
        return
    if memory:
        limit = f", cgroup {_mib(memory.get('cgroup_usage'))} of {_mib(memory['cgroup_limit'])}" if memory.get("cgroup_limit") else ""
        click.echo(f"\nmemory: server {_mib(memory.get('rss'))} resident, {_mib(memory.get('available'))} available{limit}")
    models = sorted({m for _, name, _ in _TAILS for m in tails.get(name, {})})
    rows = []
    for model in models:
        count = tails.get("edgechat_request_prompt_tokens", {}).get(model, (0, []))[0]
        if count:
            rows.append([model, str(count), *(_quantiles(tails[name].get(model), unit) for _, name, unit in _TAILS)])
    if rows:
        click.echo("\nrequests (p50 / p95 / p99):")
        click.echo(_table(["MODEL", "DONE", *(column for column, _, _ in _TAILS)], rows))


def _quantiles(entry, unit: str) -> str:
    if not entry or not entry[0]:
        return "-"
    return " / ".join("-" if v is None else (f"{v:.2f}" if unit else f"{v:.0f}") for v in entry[1]) + (f" {unit}" if unit else "")
