"""Turning a model name, a path or a Hub reference into a local GGUF file, and describing it."""

from edgechat.models.ggufinfo import ModelInfo, read_model_info
from edgechat.models.resolve import (
    DEFAULT_MODEL,
    catalog_draft,
    display_name,
    find_projector,
    known_model_names,
    resolve_model,
)

__all__ = ["DEFAULT_MODEL", "catalog_draft", "display_name", "find_projector", "ModelInfo", "known_model_names", "read_model_info", "resolve_model"]
