"""Model references: an embedded short name, a path to a .gguf, or a file in the models cache."""

from __future__ import annotations

import difflib
from pathlib import Path

from edgechat.config import Paths
from edgechat.errors import ModelNotFoundError
from edgechat.models.embedded import ALIASES, EMBEDDED

DEFAULT_MODEL = "smollm2-135m-instruct"


def known_model_names(paths: Paths) -> list[str]:
    names = list(EMBEDDED)
    if paths.models_cache.is_dir():
        names += sorted(p.stem for p in paths.models_cache.glob("*.gguf"))
    return list(dict.fromkeys(names))


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
    if path.is_dir():
        raise ModelNotFoundError(f"{ref} is a directory, not a model file; pass the .gguf file inside it")
    if path.is_file():
        return path.resolve()
    cached = paths.models_cache / f"{ref}.gguf"
    if cached.is_file():
        return cached
    if looks_like_path:
        raise ModelNotFoundError(f"model file not found: {ref}")
    names = known_model_names(paths) + list(ALIASES)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else "see: edgechat models"
    raise ModelNotFoundError(f"unknown model '{ref}'; {hint}")
