"""Model references: an embedded short name, a path to a .gguf, a file in the models cache,
a catalog name, or a Hugging Face Hub reference."""

from __future__ import annotations

import difflib
from pathlib import Path

from edgechat.config import Paths
from edgechat.errors import ModelNotFoundError
from edgechat.models import catalog, hub
from edgechat.models.embedded import ALIASES, EMBEDDED, GEMMA3_FILE
from edgechat.models.ggufinfo import model_stem, read_projector_info, split_part_names
from edgechat.models.onnxinfo import is_onnx_folder

DEFAULT_MODEL = "smollm2-135m-instruct"


def known_model_names(paths: Paths) -> list[str]:
    names = list(EMBEDDED)
    if paths.models_cache.is_dir():
        # the assembled embedded Gemma lives in the cache too; it is listed under its short name
        # a split model is named by its first part, the one llama.cpp is given
        names += sorted(
            p.stem for p in paths.models_cache.glob("*.gguf")
            if p.name != GEMMA3_FILE and split_part_names(p.name)[0] == p.name
        )
        names += sorted(p.name for p in paths.models_cache.iterdir() if is_onnx_folder(p))
    # catalog models count once downloaded; the default quant goes by the bare name
    for entry in catalog.load_catalog().values():
        for cfile in entry.files.values():
            if hub.is_downloaded(entry, cfile, paths):
                names.append(entry.name if cfile is entry.default else f"{entry.name}:{cfile.quant}")
    return list(dict.fromkeys(names))


def display_name(ref: str | None, path: Path) -> str:
    """What to call a model in the UI: its short name when embedded, else the file's stem."""
    name = ALIASES.get((ref or DEFAULT_MODEL).lower(), (ref or DEFAULT_MODEL).lower())
    return name if name in EMBEDDED else model_stem(path)


def resolve_model(ref: str | None, paths: Paths) -> Path:
    """Return the local GGUF file for `ref`, or raise a one-line error that suggests what to type."""
    ref = (ref or DEFAULT_MODEL).strip()
    if not ref:
        raise ModelNotFoundError("empty model name; try: edgechat models")
    name = ALIASES.get(ref.lower(), ref.lower())
    if name in EMBEDDED:
        return EMBEDDED[name].locate(paths)
    path = Path(ref).expanduser()
    looks_like_path = ref.endswith(".gguf") or "/" in ref or ref.startswith(".")
    if is_onnx_folder(path):
        return path.absolute()
    if path.is_dir():
        raise ModelNotFoundError(f"{ref} is a directory, not a model file; pass the .gguf file inside it")
    if path.is_file():
        # absolute, not resolved: llama.cpp finds a split model's other parts beside the name it is
        # given, and the Hugging Face cache's files are links to blobs with other names
        return path.absolute()
    cached = paths.models_cache / f"{ref}.gguf"
    if cached.is_file():
        return cached
    if is_onnx_folder(paths.models_cache / ref):
        return paths.models_cache / ref
    if found := catalog.lookup(ref):
        return hub.resolve_catalog(*found, paths)
    if hub_ref := hub.parse_hub_ref(ref):
        return hub.resolve_hub(hub_ref, paths)
    if looks_like_path:
        hint = f" (a Hub repository? add a quant: {ref}:Q4_K_M)" if hub.looks_like_repo(ref) else ""
        raise ModelNotFoundError(f"model file not found: {ref}{hint}")
    names = known_model_names(paths) + list(ALIASES) + list(catalog.load_catalog())
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else "see: edgechat models"
    raise ModelNotFoundError(f"unknown model '{ref}'; {hint}")


def catalog_draft(ref: str | None, paths: Paths) -> str | None:
    """The draft model the catalog names for `ref`, when it is here already (embedded or pulled):
    a draft is an aid, never a reason to download."""
    found = catalog.lookup((ref or DEFAULT_MODEL).strip())
    draft = found[0].draft if found else None
    if draft is None:
        return None
    if draft in EMBEDDED:
        return draft
    entry = catalog.load_catalog()[draft]
    return draft if hub.is_downloaded(entry, entry.default, paths) else None


def find_projector(given: str | None, model_path: Path, ref: str | None = None, paths: Paths | None = None) -> Path | None:
    """The projector (mmproj GGUF) that lets the model at `model_path` read images: the file
    given (--mmproj, checked to be a projector), else the mmproj*.gguf beside the model file (the
    Hub repos' layout; the f16 one where there are several), else the one a pull of `ref` put in
    the cache (beside the model too, unless the repo changed between the two downloads), else
    None (a text-only model)."""
    if given:
        return read_projector_info(Path(given).expanduser()).path.absolute()
    if model_path.is_dir():
        return None
    if beside := hub.pick_projector(p.name for p in model_path.parent.glob("*.gguf")):
        return (model_path.parent / beside).absolute()
    return hub.cached_projector(ref, paths) if ref is not None and paths is not None else None
