"""The engine: the only part of edgechat that drives llama.cpp.

    engine = Engine(EngineConfig(model="smollm2-135m-instruct"))
    handle = engine.submit(ChatRequest(messages=[{"role": "user", "content": "hi"}]))
    for event in handle: ...   # TextDelta, ToolCallEvent, Evicted, Metrics, then Finished

Engine and EngineConfig load llama.cpp on first use, so front ends can import the request and
event types (and start drawing) without paying for it.
"""

from edgechat.engine.types.request import (
    FINISH_REASONS,
    ChatRequest,
    ContextPolicy,
    Event,
    Evicted,
    Finished,
    ImageInput,
    Metrics,
    RequestHandle,
    RequestMetrics,
    RequestStatus,
    TextDelta,
    ToolCall,
    ToolCallEvent,
)
from edgechat.params import SamplingParams

__all__ = [
    "FINISH_REASONS",
    "ChatRequest",
    "ContextPolicy",
    "Engine",
    "EngineConfig",
    "Event",
    "Evicted",
    "Finished",
    "ImageInput",
    "Metrics",
    "RequestHandle",
    "RequestMetrics",
    "RequestStatus",
    "SamplingParams",
    "TextDelta",
    "ToolCall",
    "ToolCallEvent",
    "open_engine",
]


def open_engine(config):
    """The engine for config.model: one Engine, its runner onnxruntime's for an ONNX folder,
    llama.cpp's otherwise (Engine picks it)."""
    from pathlib import Path

    from edgechat.config import get_paths
    from edgechat.models.onnxinfo import is_onnx_folder

    # a path, or a folder's name in the models folder (as resolve_model finds it)
    folders = (Path(config.model).expanduser(), (config.paths or get_paths()).models_cache / config.model) if config.model else ()
    if getattr(config, "ep", None) and not any(is_onnx_folder(folder) for folder in folders):
        from edgechat.errors import UsageError

        raise UsageError("--ep is for ONNX model folders; llama.cpp places GGUF layers itself (--gpu-layers)")
    from edgechat.engine.core import Engine

    return Engine(config)


def __getattr__(name: str):
    if name in ("Engine", "EngineConfig"):
        from edgechat.engine import core

        return getattr(core, name)
    raise AttributeError(f"module 'edgechat.engine' has no attribute {name!r}")
