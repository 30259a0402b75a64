"""What one server instance is configured with (the engine's own settings live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgechat.server.priority import PriorityClass


@dataclass(frozen=True)
class ServerSettings:
    #: every endpoint but /health then needs `Authorization: Bearer <api_key>`
    api_key: str | None = None
    #: prompts longer than this get 400 before any compute (None: only the context limits them)
    max_input_tokens: int | None = None
    #: a request still generating after this many seconds is cancelled
    request_timeout: float = 600.0
    #: bytes of free memory below which the server sheds (server/memoryguard.py); None: never
    memory_floor: int | None = None
    #: the id /v1/models lists and responses carry (None: the model file's name without .gguf)
    model_id: str | None = None
    #: more names the primary model answers to in every API; /v1/models lists them too
    aliases: tuple[str, ...] = ()
    #: a request naming a model this server does not have gets the primary one, not a 404
    #: (for clients that hard-code a model name)
    any_model_name: bool = False
    #: origins whose browser pages may call the API ("*": any); empty: no CORS headers at all
    cors_origins: tuple[str, ...] = ()
    #: average queue wait (seconds) that turns the degrade switch on; None disables it
    degrade_queue_wait: float | None = 10.0
    #: the max_tokens cap while degraded
    degrade_max_tokens: int = 256
    #: a reasoning model's thinking budget when a request names none (None: no limit, 0: off)
    reasoning_budget: int | None = None
    #: "auto": thoughts apart in reasoning_content; "none": left in the content as the model wrote them
    reasoning_format: str = "auto"
    #: request bodies larger than this get 413; room for a few images sent as base64 data URLs
    max_body_bytes: int = 64 * 1024 * 1024
    #: the folder whose files a request may name as file:// image URLs (None: no file URLs)
    image_dir: Path | None = None
    #: an image's bytes, its pixels (from its header) and the images in one request beyond
    #: these get 400
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_megapixels: float = 33.2
    max_images: int = 16
    #: chat requests with more messages get 400 before any templating. Chat templates frame each
    #: message with ~5 tokens, so 2,048 messages need over 10k tokens before any text: more than
    #: the default 4,096-token context holds, while building a prompt that size stays cheap.
    max_messages: int = 2048
    #: Retry-After seconds sent with 429 when nothing better is known
    retry_after: int = 1
    #: a stream with nothing to send for this long gets an SSE comment (waiting in the queue,
    #: a long prefill), so proxies and clients with read timeouts keep the connection
    keepalive_s: float = 15.0
    #: priority classes, each with its own share of the sequences and its own queue (priority.py);
    #: empty: one queue for everyone, in arrival order
    priority_classes: tuple[PriorityClass, ...] = ()
    #: API key -> its priority class; these keys are accepted besides api_key
    key_classes: dict[str, str] = field(default_factory=dict)
    #: the class of a request whose key has none and that names none in X-Priority
    default_class: str | None = None
    #: a request with no first token after this many seconds moves to the fallback model instead
    #: of waiting on (X-Failover-After overrides it per request); None: only if a request asks
    failover_after: float | None = None
