"""Hugging Face Hub references: downloaded once into edgechat's cache, read from it offline after.

Forms: `hf:OWNER/REPO/FILE.gguf`, `OWNER/REPO:QUANT` (or `hf:OWNER/REPO[:QUANT]`, default Q4_K_M),
and catalog names (`qwen2.5-0.5b-instruct`, `qwen2.5-0.5b-instruct:Q8_0`).
A file already in the cache is used without asking the network, so a pulled model never
waits on (or breaks with) the Hub. HF_HUB_OFFLINE=1 forbids the network altogether.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgechat.android import on_android
from edgechat.config import Paths
from edgechat.errors import ModelFormatError, ModelNotFoundError, UsageError
from edgechat.models.catalog import QUANT_RE, CatalogEntry, CatalogFile, load_catalog, lookup
from edgechat.models.ggufinfo import GGUF_MAGIC, split_part_names

if on_android():
    # huggingface_hub reads it once, at its import (always after this module's): hf-xet is a Rust
    # build that does not install on Termux, so plain HTTP downloads are used
    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")

HUB_PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"
_REPO = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
_QUANT_REF = re.compile(rf"^(?P<repo>{_REPO})(?::(?P<quant>[A-Za-z0-9_]+))?$")
_FILE_REF = re.compile(rf"^(?P<repo>{_REPO})/(?P<file>[^:\\]+)$")
_USAGE = "write hf:OWNER/REPO/FILE.gguf or OWNER/REPO:QUANT, e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"


@dataclass(frozen=True)
class HubRef:
    repo: str
    #: exact file in the repo, or None to pick one by `quant`
    file: str | None
    quant: str | None
    #: what the user typed, for messages and `edgechat pull` hints
    text: str


def parse_hub_ref(ref: str) -> HubRef | None:
    """The Hub reference in `ref`, None when it is not one; a malformed `hf:` reference is an error."""
    text = ref.strip()
    explicit = text.lower().startswith(HUB_PREFIX)
    body = text[len(HUB_PREFIX):] if explicit else text
    if explicit and body.count("/") >= 2:
        m = _FILE_REF.match(body)
        if m is None or ".." in m["file"].split("/"):
            raise ModelNotFoundError(f"malformed Hub reference '{text}'; {_USAGE}")
        if not m["file"].lower().endswith(".gguf"):
            raise ModelNotFoundError(f"{text}: edgechat runs GGUF files only; name a .gguf file ({_USAGE})")
        return HubRef(m["repo"], m["file"], None, text)
    m = _QUANT_REF.match(body)
    if m is None or not (explicit or m["quant"]):
        if explicit:
            raise ModelNotFoundError(f"malformed Hub reference '{text}'; {_USAGE}")
        return None
    quant = (m["quant"] or DEFAULT_QUANT).upper()
    if not QUANT_RE.match(quant):
        if not explicit:
            return None
        raise ModelNotFoundError(f"{text}: '{m['quant']}' is not a GGUF quant name like Q4_K_M or Q8_0")
    return HubRef(m["repo"], None, quant, text)


def pull_ref(text: str) -> HubRef:
    """What a pull of `text` downloads: a catalog name (NAME or NAME:QUANT) or a Hub reference."""
    if found := lookup(text):
        entry, cfile = found
        return HubRef(entry.repo, cfile.file, cfile.quant, text)
    ref = parse_hub_ref(text)
    if ref is None:
        raise UsageError(f"'{text}' is neither a catalog name nor a Hub reference; see: edgechat models --catalog")
    return ref


def looks_like_repo(ref: str) -> bool:
    """OWNER/REPO with nothing after it: a Hub repository named without a quant or file."""
    return re.fullmatch(_REPO, ref.strip()) is not None and not ref.strip().lower().endswith(".gguf")


def hub_cache(paths: Paths) -> Path:
    return paths.models_cache / "hub"


def offline() -> bool:
    # read at call time: huggingface_hub reads it once at import, before tests or callers set it
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


class HubUnreachableError(ModelNotFoundError):
    """The model is not here and the Hub cannot be asked for it (offline mode, or no network).
    The message suits a command that wanted to run the model; `pull` words its own from `why`."""

    def __init__(self, text: str, why: str):
        super().__init__(f"{text} is not downloaded and {why}; connect once and run `edgechat pull {text}`")
        self.why = why


def _unreachable(text: str, why: str | None = None) -> HubUnreachableError:
    return HubUnreachableError(text, "HF_HUB_OFFLINE is set" if offline() else why or "the Hub cannot be reached")


def check_reachable(text: str) -> None:
    """Raise HubUnreachableError, in a second at most, when the Hub cannot be asked for `text`."""
    if offline():
        raise _unreachable(text)
    _probe_hub(text)


def _probe_hub(text: str) -> None:
    """Fail in a second when the Hub cannot be reached: huggingface_hub retries a failed
    connection with back-off for ~25 s, and a name that does not resolve never gets better."""
    import socket
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    url = urllib.parse.urlsplit(_endpoint() or constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(url.scheme)
    target = urllib.parse.urlsplit(proxy) if proxy and not urllib.request.proxy_bypass(url.hostname or "") else url
    host, port = target.hostname or "", target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=_PROBE_TIMEOUT).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise _unreachable(text, f"the Hub ({url.hostname}) cannot be reached ({reason})") from None


#: seconds a connection to the Hub may take before this machine counts as offline
_PROBE_TIMEOUT = 3.0


def cached_file(repo: str, file: str, paths: Paths) -> Path | None:
    """The cached copy of repo/file (newest revision the cache knows), or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, file, cache_dir=hub_cache(paths))
    return Path(found) if isinstance(found, str) else None


def _matches_quant(file: str, quant: str) -> bool:
    name = file.rsplit("/", 1)[-1]
    # Q4_0 must not match Q4_0_4_4, Q4_K must not match Q4_K_M: the quant ends at a non-word char
    return (
        name.lower().endswith(".gguf")
        and "mmproj" not in name.lower()
        and re.search(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", name, re.IGNORECASE) is not None
    )


def _pick(ref: HubRef, files: list[str]) -> str:
    """The file for ref's quant; for a model split in parts, its first part (the one llama.cpp is given)."""
    quant = ref.quant
    assert quant is not None, "a reference that names no file names a quant (parse_hub_ref)"
    matches = sorted(f for f in files if _matches_quant(f, quant))
    if not matches:
        have = sorted({q for f in files for q in _quants_in(f)})
        listing = f"it has {', '.join(have)}" if have else "it holds no GGUF files"
        raise ModelNotFoundError(f"{ref.repo} has no {ref.quant} GGUF file; {listing}")
    matches = [f for f in matches if split_part_names(f)[0] == f] or matches
    if len(matches) > 1:
        raise ModelNotFoundError(
            f"{ref.repo} has several {ref.quant} files ({', '.join(matches)}); name one: hf:{ref.repo}/{matches[0]}"
        )
    return matches[0]


def _quants_in(file: str) -> list[str]:
    if not file.lower().endswith(".gguf"):
        return []
    return [t.upper() for t in re.split(r"[-.]", file.rsplit("/", 1)[-1][: -len(".gguf")]) if QUANT_RE.match(t.upper())]


def cached_revisions(repo: str, paths: Paths) -> list[tuple[Path, list[str]]]:
    """The cached revisions of `repo` (refs/main's first, then the newest) that hold GGUF files,
    each with those files' paths within it."""
    from huggingface_hub.file_download import repo_folder_name

    root = hub_cache(paths) / repo_folder_name(repo_id=repo, repo_type="model")
    snapshots = root / "snapshots"
    if not snapshots.is_dir():
        return []
    main = root / "refs" / "main"
    order = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    if main.is_file():
        head = snapshots / main.read_text().strip()
        order = [head] + [p for p in order if p != head]
    found = [(snapshot, [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf") if p.is_file()])
             for snapshot in order]
    return [(snapshot, names) for snapshot, names in found if names]


def is_projector_name(file: str) -> bool:
    """A vision (or audio) projector by the Hub repos' naming: mmproj in a .gguf file's name."""
    name = file.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and "mmproj" in name


def pick_projector(files) -> str | None:
    """The projector among a repo's (or a folder's) file names: the only one, else the f16 one
    (repos ship f16, bf16, f32 or quantized copies of the same encoder); None otherwise."""
    found = sorted(f for f in files if is_projector_name(f))
    if len(found) > 1:
        found = [f for f in found if re.search(r"(?<![a-z0-9])f16(?![a-z0-9])", f.rsplit("/", 1)[-1].lower())]
    return found[0] if len(found) == 1 else None


def _catalog_file_for(ref: HubRef) -> str | None:
    """A quant reference to a catalogued repo needs no listing: the catalog knows the file."""
    for entry in load_catalog().values():
        if entry.repo.lower() == ref.repo.lower() and ref.quant in entry.files:
            return entry.files[ref.quant].file
    return None


#: told (bytes of the file done, its bytes in all) as a download goes; an exception it raises
#: stops the download there, and nothing of it is left in the cache's place
Progress = Callable[[int, int | None], None]


def cached(ref: HubRef, paths: Paths) -> Path | None:
    """The local GGUF for a Hub reference when the cache holds all of it, asking no network."""
    file = ref.file or _catalog_file_for(ref)
    if file is None:
        return _cached_pick(ref, paths)
    # a split model's parts, all of them, side by side in one snapshot: llama.cpp opens them by name
    names = split_part_names(file)
    parts = [cached_file(ref.repo, part, paths) for part in names]
    if all(parts):
        return parts[0]
    # a later download of another file of the repo (its projector, another quant) moved refs/main
    # to a revision without this one: an older revision has it
    return next((snapshot / file for snapshot, have in cached_revisions(ref.repo, paths) if set(names) <= set(have)), None)


def resolve_hub(ref: HubRef, paths: Paths, progress: Progress | None = None) -> Path:
    """Local GGUF for a Hub reference: from the cache, else downloaded (unless offline)."""
    if found := cached(ref, paths):
        return found
    if offline():
        raise _unreachable(ref.text)
    file = ref.file or _catalog_file_for(ref) or _pick(ref, _list_repo_files(ref))
    return [cached_file(ref.repo, part, paths) or _download(ref.repo, part, ref.text, paths, progress)
            for part in split_part_names(file)][0]


def _cached_pick(ref: HubRef, paths: Paths) -> Path | None:
    """The cached file for a reference without one (picked by quant), every part of it here."""
    for snapshot, names in cached_revisions(ref.repo, paths):
        # only other quants of this repo (or some parts of a split one) are cached: the Hub's listing decides
        with contextlib.suppress(ModelNotFoundError):
            picked = _pick(ref, names)
            if set(split_part_names(picked)) <= set(names):
                return snapshot / picked
    return None


def download_size(ref: HubRef, paths: Paths, with_projector: bool = False) -> int | None:
    """The bytes resolve_hub would download for ref, from the Hub's listing (every part of a
    split model; `with_projector`: and the projector pull_projector would bring with it); None
    when the file is already here or the listing does not give them."""
    file = ref.file or _catalog_file_for(ref)
    names: list[str] | None = None
    if file is None:
        if _cached_pick(ref, paths):
            return None  # here already: no Hub call
        names = _list_repo_files(ref)
        file = _pick(ref, names)
    missing = [part for part in split_part_names(file) if cached_file(ref.repo, part, paths) is None]
    if missing and with_projector and cached_projector(ref.text, paths) is None:
        # it runs beside the model: the two must fit together
        if projector := pick_projector(_list_repo_files(ref) if names is None else names):
            missing.append(projector)
    listed = [listed_file(ref.repo, part, ref.text) for part in missing]
    sizes = [entry.size for entry in listed if entry is not None]
    if not missing or len(sizes) < len(listed):
        return None
    return sum(sizes)


def resolve_catalog(entry: CatalogEntry, cfile: CatalogFile, paths: Paths, progress: Progress | None = None) -> Path:
    text = entry.name if cfile is entry.default else f"{entry.name}:{cfile.quant}"
    return resolve_hub(HubRef(entry.repo, cfile.file, cfile.quant, text), paths, progress)


def is_downloaded(entry: CatalogEntry, cfile: CatalogFile, paths: Paths) -> bool:
    return cached(HubRef(entry.repo, cfile.file, cfile.quant, entry.name), paths) is not None


def cached_projector(text: str, paths: Paths) -> Path | None:
    """The projector a pull of `text` put in the cache, asking no network: a catalog entry's
    mmproj, a Hub repo's (pick_projector) in its newest cached revision that has one. A later
    pull of the same repo can land in another revision's folder than the model's."""
    with contextlib.suppress(ModelNotFoundError):
        file: str | None = None  # the catalog's, else picked from what the cache holds
        if found := lookup(text):
            if found[0].mmproj is None:
                return None
            repo, file = found[0].repo, found[0].mmproj.file
        elif ref := parse_hub_ref(text):
            repo = ref.repo
        else:
            return None
        for snapshot, names in cached_revisions(repo, paths):
            if picked := pick_projector(names) if file is None else (file if file in names else None):
                return snapshot / picked
    return None


def pull_projector(text: str, paths: Paths, list_repo: bool = True, progress: Progress | None = None) -> Path | None:
    """The projector of what `text` pulls, downloaded unless cached (checked like the model:
    the listing's size and sha256, then its header must be a projector's): a catalog entry's
    mmproj, or the one pick_projector finds in a Hub repo's listing (only when `list_repo`).
    None when it has none; HubUnreachableError when it must come and cannot."""
    from edgechat.models.ggufinfo import read_projector_info

    if found := cached_projector(text, paths):
        return found
    if entry := lookup(text):
        if entry[0].mmproj is None:
            return None
        repo, file = entry[0].repo, entry[0].mmproj.file
    else:
        ref = parse_hub_ref(text)
        picked = pick_projector(_list_repo_files(ref)) if ref is not None and list_repo else None
        if ref is None or picked is None:
            return None
        repo, file = ref.repo, picked
    path = _download(repo, file, text, paths, progress)
    try:
        read_projector_info(path)
    except ModelFormatError:
        _drop(path)
        raise ModelFormatError(f"{text}: the Hub's {file} is not a projector (mmproj) GGUF; it was not kept") from None
    return path


def _list_repo_files(ref: HubRef) -> list[str]:
    from huggingface_hub import HfApi

    with _hub_errors(ref.text, ref.repo):
        return HfApi(endpoint=_endpoint()).list_repo_files(ref.repo)


@contextlib.contextmanager
def _progress_on_tty():
    """Hub progress bars on a terminal only; piped output and logs stay clean."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not sys.stderr.isatty():
        disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


@dataclass(frozen=True)
class ListedFile:
    size: int
    #: the LFS object's sha256 (how the Hub stores GGUF files); None for a file kept in git itself
    sha256: str | None


def listed_file(repo: str, file: str, text: str) -> ListedFile | None:
    """What the Hub's file listing says of repo/file; None when it does not list it."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    folder = file.rsplit("/", 1)[0] if "/" in file else None
    with _hub_errors(text, repo, file):
        for entry in HfApi(endpoint=_endpoint()).list_repo_tree(repo, path_in_repo=folder):
            if isinstance(entry, RepoFile) and entry.path == file:
                return ListedFile(entry.size, entry.lfs.sha256 if entry.lfs else None)
    return None


def _drop(path: Path) -> None:
    """Remove a cached download: its snapshot link and the blob it points to."""
    blob = path.resolve()
    path.unlink()
    blob.unlink(missing_ok=True)


def _reporting_bar(progress: Progress) -> type:
    """A tqdm class for hf_hub_download that draws nothing and tells `progress` every chunk."""
    from huggingface_hub.utils import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

        def update(self, n=1):
            self.n += n
            progress(self.n, self.total)

        def update_transfer(self, n):
            # having it makes a Xet download count on one bar (bytes written) instead of two
            pass

    return Bar


def hub_file(repo: str, file: str, text: str, paths: Paths) -> Path:
    """Any one file of a Hub repo (not a GGUF: a speech model's), from the cache or downloaded."""
    if found := cached_file(repo, file, paths):
        return found
    if offline():
        raise _unreachable(text)
    return _download(repo, file, text, paths, gguf=False)


def _download(repo: str, file: str, text: str, paths: Paths, progress: Progress | None = None, gguf: bool = True) -> Path:
    from huggingface_hub import hf_hub_download

    from edgechat.models.embedded import sha256_file

    cache = hub_cache(paths)
    cache.mkdir(parents=True, exist_ok=True)
    listed = listed_file(repo, file, text)
    # hf_hub_download writes to an .incomplete file, resumes it after an interruption, and
    # renames it into place only when complete, so a half-downloaded model is never loaded.
    with _hub_errors(text, repo, file), _progress_on_tty():
        path = Path(hf_hub_download(repo, file, cache_dir=cache, endpoint=_endpoint(), library_name="edgechat",
                                    tqdm_class=_reporting_bar(progress) if progress else None))
    # checked against the listing, not the transfer: a proxy or a broken mirror can serve other bytes
    size = path.stat().st_size
    if listed is not None and size != listed.size:
        _drop(path)
        raise ModelFormatError(f"{text}: {file} arrived with {size:,} bytes, the Hub lists {listed.size:,}; "
                               "it was not kept, pull it again")
    if listed is not None and listed.sha256 and (got := sha256_file(path)) != listed.sha256:
        _drop(path)
        raise ModelFormatError(f"{text}: {file}'s sha256 is {got[:12]}…, the Hub's is {listed.sha256[:12]}…; "
                               "it was not kept, pull it again")
    if not gguf:
        return path
    with open(path, "rb") as fh:
        is_gguf = fh.read(4) == GGUF_MAGIC
    if not is_gguf:
        # a file named .gguf that is not one would fail every later run from the cache: drop it
        _drop(path)
        raise ModelFormatError(f"{text}: the Hub's {file} is not a GGUF file; it was not kept")
    return path


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection failures of whichever HTTP client this huggingface_hub release is built on."""
    found = []
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        with contextlib.suppress(ImportError):
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


@contextlib.contextmanager
def _hub_errors(text: str, repo: str, file: str | None = None):
    """Every Hub failure becomes one ModelNotFoundError line that says what to do."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    check_reachable(text)
    unreachable: tuple[type[BaseException], ...] = (LocalEntryNotFoundError, OfflineModeIsEnabled, *_network_errors())
    try:
        yield
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{repo} is gated: accept its licence on huggingface.co, log in with `hf auth login`, then retry"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"no Hub repository {repo} (or it is private); check the name: {text}") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo} has no main revision; check the reference {text}") from None
    except unreachable:
        raise _unreachable(text) from None
    except EntryNotFoundError:
        raise ModelNotFoundError(f"{repo} has no file {file}; see https://huggingface.co/{repo}/tree/main") from None
    except HfHubHTTPError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(f"the Hub refused {text}: {first}") from None
    except OSError as exc:
        raise ModelNotFoundError(f"cannot download {text}: {exc.strerror or exc}") from None
