"""The curated model catalog (catalog.toml, shipped inside the package): loading, checking, lookup."""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass
from importlib import resources

from edgechat.errors import ModelNotFoundError
from edgechat.models.embedded import EMBEDDED

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

#: GGUF quantization names as llama.cpp and the usual uploaders spell them in file names
QUANT_RE = re.compile(
    r"^(?:IQ[1-4]_(?:XXS|XS|S|M|NL)|Q[2-8]_K(?:_(?:S|M|L|XL))?|Q[4-8]_[01]|TQ[12]_0|MXFP4|F16|BF16|F32)$"
)
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_FIELDS = {"name": str, "repo": str, "architecture": str, "licence": str, "context": int, "description": str}


@dataclass(frozen=True)
class CatalogFile:
    quant: str
    file: str
    size: int


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    repo: str
    architecture: str
    licence: str
    context: int
    description: str
    #: quant -> file, in catalog order; the first is the default
    files: dict[str, CatalogFile]
    #: a smaller model of the same tokenizer that drafts for this one (speculative decoding)
    draft: str | None = None
    #: a reasoning model: it thinks before it answers (its template opens a thinking block)
    thinks: bool = False
    #: the vision projector (mmproj GGUF) in the same repo, pulled with the model (quant "mmproj")
    mmproj: CatalogFile | None = None

    @property
    def default(self) -> CatalogFile:
        return next(iter(self.files.values()))

    def file_for(self, quant: str | None) -> CatalogFile:
        if quant is None:
            return self.default
        found = self.files.get(quant)
        if found is None:
            raise ModelNotFoundError(
                f"{self.name} has no {quant} file in the catalog; it has {', '.join(self.files)} "
                f"(any other quant: {self.repo}:{quant})"
            )
        return found


def parse_catalog(data: dict) -> dict[str, CatalogEntry]:
    """Check a parsed catalog and build its entries; ValueError lists every problem found."""
    problems: list[str] = []
    entries: dict[str, CatalogEntry] = {}
    if data.get("schema") != 1:
        problems.append(f"schema is {data.get('schema')!r}, expected 1")
    models = data.get("model")
    if not isinstance(models, list) or not models:
        problems.append("no [[model]] entries")
        models = []
    for i, raw in enumerate(models):
        where = f"model #{i + 1} ({raw.get('name', '?')})"
        for field, kind in _FIELDS.items():
            if not isinstance(raw.get(field), kind) or raw.get(field) in ("", 0):
                problems.append(f"{where}: {field} missing or not a {kind.__name__}")
        unknown = set(raw) - set(_FIELDS) - {"files", "draft", "thinks", "mmproj"}
        if unknown:
            problems.append(f"{where}: unknown fields {sorted(unknown)}")
        name, repo = str(raw.get("name", "")), str(raw.get("repo", ""))
        if name and not _NAME_RE.match(name):
            problems.append(f"{where}: name must be lower case letters, digits, '.', '-' or '_'")
        if name in entries:
            problems.append(f"{where}: duplicate name")
        if repo and not _REPO_RE.match(repo):
            problems.append(f"{where}: repo must be OWNER/NAME")
        draft = raw.get("draft")
        if draft is not None and (not isinstance(draft, str) or draft == name):
            problems.append(f"{where}: draft must name another model")
        if not isinstance(raw.get("thinks", False), bool):
            problems.append(f"{where}: thinks must be true or false")
        files: dict[str, CatalogFile] = {}
        raw_files = raw.get("files")
        if not isinstance(raw_files, dict) or not raw_files:
            problems.append(f"{where}: no files")
            raw_files = {}
        for quant, spec in raw_files.items():
            if not QUANT_RE.match(quant):
                problems.append(f"{where}: {quant!r} is not a GGUF quant name")
            if not isinstance(spec, dict) or not isinstance(spec.get("file"), str) or not isinstance(spec.get("size"), int):
                problems.append(f"{where}: files.{quant} needs file (string) and size (bytes)")
                continue
            if not spec["file"].endswith(".gguf"):
                problems.append(f"{where}: files.{quant} is not a .gguf file")
            if spec["size"] <= 0:
                problems.append(f"{where}: files.{quant} size must be positive")
            files[quant] = CatalogFile(quant, spec["file"], spec["size"])
        mmproj = None
        if "mmproj" in raw:
            spec = raw["mmproj"]
            if not isinstance(spec, dict) or not isinstance(spec.get("file"), str) or not isinstance(spec.get("size"), int):
                problems.append(f"{where}: mmproj needs file (string) and size (bytes)")
            elif not spec["file"].endswith(".gguf") or "mmproj" not in spec["file"].lower() or spec["size"] <= 0:
                problems.append(f"{where}: mmproj must be an mmproj*.gguf file of a positive size")
            else:
                mmproj = CatalogFile("mmproj", spec["file"], spec["size"])
        if name and files and name not in entries:
            entries[name] = CatalogEntry(
                name=name,
                repo=repo,
                architecture=str(raw.get("architecture", "")),
                licence=str(raw.get("licence", "")),
                context=int(raw.get("context", 0) or 0),
                description=str(raw.get("description", "")),
                files=files,
                draft=draft if isinstance(draft, str) else None,
                thinks=raw.get("thinks") is True,
                mmproj=mmproj,
            )
    for entry in entries.values():
        if entry.draft is not None and entry.draft not in entries and entry.draft not in EMBEDDED:
            problems.append(f"{entry.name}: draft {entry.draft!r} is not a catalog or embedded model")
    if problems:
        raise ValueError("model catalog: " + "; ".join(problems))
    return entries


@functools.cache
def load_catalog() -> dict[str, CatalogEntry]:
    """The catalog shipped with this install (read once per process)."""
    text = resources.files("edgechat.models").joinpath("catalog.toml").read_text(encoding="utf-8")
    return parse_catalog(tomllib.loads(text))


def format_size(n: float) -> str:
    """Bytes as every listing shows them: MiB below a GiB, GiB with one decimal above."""
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.1f} GiB"


@dataclass(frozen=True)
class CatalogRow:
    """A catalog entry not downloaded yet, as `edgechat models` and the chat app's picker show it."""

    name: str
    size: str
    quant: str
    architecture: str
    context: int
    description: str
    #: the planner's verdict from the catalog's file size alone (the file's header is not here yet)
    fits: bool

    @property
    def fit_text(self) -> str:
        return "probably (not downloaded)" if self.fits else "no: larger than free memory (not downloaded)"


def catalog_row(entry: CatalogEntry, cfile: CatalogFile | None = None, available: int | None = None) -> CatalogRow:
    """The one description of a not-downloaded entry (its default file unless `cfile` is given)."""
    from edgechat.models import planner

    cfile = cfile or entry.default
    # a vision model runs with its projector, pulled with it
    weights = cfile.size + (entry.mmproj.size if entry.mmproj else 0)
    return CatalogRow(entry.name, f"~{format_size(cfile.size)}", cfile.quant, entry.architecture, entry.context,
                      entry.description, planner.weights_fit(weights, available))


def lookup(ref: str) -> tuple[CatalogEntry, CatalogFile] | None:
    """`name` or `name:QUANT` (any case) -> entry and file; None when `ref` names no catalog entry."""
    name, _, quant = ref.strip().partition(":")
    entry = load_catalog().get(name.lower())
    if entry is None:
        return None
    return entry, entry.file_for(quant.upper() or None)
