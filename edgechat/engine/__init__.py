"""The engine: the only part of edgechat that drives llama.cpp.

    engine = Engine(EngineConfig(model="smollm2-135m-instruct"))
    handle = engine.submit(ChatRequest(messages=[{"role": "user", "content": "hi"}]))
    for event in handle: ...   # TextDelta, Evicted, Metrics, then Finished
"""

from edgechat.engine.core import Engine, EngineConfig
from edgechat.engine.request import (
    FINISH_REASONS,
    ChatRequest,
    ContextPolicy,
    Event,
    Evicted,
    Finished,
    Metrics,
    RequestHandle,
    RequestMetrics,
    RequestStatus,
    SamplingParams,
    TextDelta,
)

__all__ = [
    "FINISH_REASONS",
    "ChatRequest",
    "ContextPolicy",
    "Engine",
    "EngineConfig",
    "Event",
    "Evicted",
    "Finished",
    "Metrics",
    "RequestHandle",
    "RequestMetrics",
    "RequestStatus",
    "SamplingParams",
    "TextDelta",
]
