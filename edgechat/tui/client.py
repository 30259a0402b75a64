"""What the chat app talks to: a local engine or an OpenAI-compatible server, behind one small protocol.

The app never imports llama.cpp. It builds a ChatRequest, calls `client.submit()`, and iterates the
handle it gets back for the engine's events (TextDelta, Evicted, Metrics, Finished), in a worker
thread. `handle.cancel()` may be called from any thread.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from edgechat.config import Paths
from edgechat.engine.types.request import (
    ChatRequest,
    Event,
    Finished,
    Metrics,
    RequestMetrics,
    TextDelta,
)
from edgechat.errors import EdgechatError, ModelNotFoundError, UsageError
from edgechat.params import KVType

if TYPE_CHECKING:
    import httpx


class Handle(Protocol):
    def __iter__(self) -> Iterator[Event]: ...

    def cancel(self) -> None: ...


class ChatClient(Protocol):
    #: what the status bar shows
    model_name: str
    #: "CPU", "GPU 12/30 layers", or "remote http://..."
    backend: str
    #: context tokens per conversation; None when the server does not say
    n_ctx: int | None
    #: "chat", "family:<name>" (a known format the file lacks) or "completion" (no chat format)
    template_mode: str
    #: one line for the user when the chat format is a fallback, else None
    template_warning: str | None
    #: the tool-call syntax of the model's template (engine/output/toolfamilies.py); None: this client
    #: cannot offer the chat app's tools (a remote server)
    tool_family: object | None
    #: the one line a model that reads no images answers one with; None: it reads them, or only
    #: the server can say (remote: its refusal comes back as the answer's error)
    image_refusal: str | None

    def submit(self, request: ChatRequest) -> Handle:
        """Start a generation; user errors (prompt too long, busy) raise EdgechatError here."""

    def release_session(self, session: str) -> None:
        """The conversation went idle: the engine may snapshot and free its KV sequence."""

    def forget_session(self, session: str) -> None:
        """The conversation was deleted: drop its KV sequence and snapshot."""

    def close(self) -> None: ...


class LocalModels:
    """The chat app's local models, held in one ModelPool: a model switched away from stays
    loaded for `idle_unload` seconds (None: for good) while memory allows (the least recently
    used idle one leaves when another needs the room), so switching back to it needs no load.
    The model in use holds a lease (its LocalClient), so neither clock nor room unloads it."""

    def __init__(self, paths: Paths, budget: int | None = None, idle_unload: float | None = None):
        from edgechat.engine.pool import ModelPool

        self.paths = paths
        self.pool = ModelPool(budget)
        self.idle_unload = idle_unload
        self._adding = threading.Lock()

    def entry(self, ref: str, config) -> str:
        """The pool's name for `ref` (its resolved file: two spellings of one model share an
        entry), added with `config` the first time it is asked for."""
        from edgechat.models import resolve_model

        name = str(resolve_model(ref, self.paths))
        with self._adding:  # two load workers may ask for one new model at once
            if name not in self.pool.models:
                self.pool.add(name, config, self.idle_unload)
        return name

    def loaded(self) -> dict[str, tuple[str, int]]:
        """Models loaded now: their file -> (display name, the planner's bytes for them)."""
        return {m.name: (m.display_name, m.need) for m in self.pool.resident()}

    def close(self) -> None:
        self.pool.close()


class LocalClient:
    """The in-process engine. Construction loads the model (or, from `models`, takes it already
    loaded): call it from a worker thread."""

    def __init__(self, model: str | None, paths: Paths, n_ctx: int | None = None, kv_type: KVType | None = None,
                 on_progress: Callable[[float], None] | None = None, engine_options: dict | None = None,
                 models: LocalModels | None = None):
        """`engine_options`: EngineConfig fields from the command line's engine options (the
        CLI's one builder of them, cli/engine_options.py); `n_ctx` and `kv_type`, where given,
        over them."""
        # Imported here: loading llama.cpp's shared library is not needed to draw the first frame.
        from edgechat.engine import EngineConfig, open_engine
        from edgechat.models import DEFAULT_MODEL
        from edgechat.models.settings import with_model_settings

        fields = dict(engine_options or {})
        fields.update({name: value for name, value in (("n_ctx", n_ctx), ("kv_type", kv_type)) if value is not None})
        # One extra sequence keeps the previous conversation hot, so switching back is instant;
        # the model's own settings in config.toml (gpu_layers, chat_template) where none is given
        config = with_model_settings(EngineConfig(model=model or DEFAULT_MODEL, hot_sessions=1, paths=paths, on_load_progress=on_progress,
                                                  **fields))
        self._models = models
        if models is None:
            self.engine = open_engine(config)
            plan = getattr(self.engine, "plan", None)
            #: what the model holds in memory: the planner's weights + KV + compute
            self.memory = plan.total if plan else 0
        else:
            self._entry = models.entry(config.model, config)
            self.engine = models.pool.acquire(self._entry)
            self.memory = models.pool.models[self._entry].need
        self._released = False
        self.model_name = self.engine.model_name
        self.n_ctx = self.engine.n_ctx
        self.template_mode = self.engine.template_mode
        self.template_warning = self.engine.template_warning
        self.tool_family = self.engine.format.tool_family
        if "vision" in self.engine.modalities:
            self.image_refusal = None
        else:
            from edgechat.engine.runners.media import no_vision

            self.image_refusal = no_vision(self.model_name)
        # where the layers went: "CPU", "CUDA0 (all 30 layers)", "CUDA0 20/30 layers, CPU 10"
        self.backend = self.engine.gpu.describe()

    def submit(self, request: ChatRequest) -> Handle:
        return self.engine.submit(request)

    def count_tokens(self, request: ChatRequest) -> int:
        return self.engine.count_tokens(request)

    def embed(self, texts: list[str]) -> list:
        """Unit vectors of `texts` from the loaded model (the relevant parts of an attachment too
        large to send whole); each text cut to the embedding context."""
        embed = getattr(self.engine, "embed", None)
        if embed is None:
            raise UsageError(f"{self.model_name} cannot embed text here (an ONNX folder); remove some attachments instead.")
        return embed(texts, truncate=True).result()

    def prompt_room(self, request: ChatRequest) -> tuple[int, int]:
        """(the request's prompt tokens, the most the context allows it): the engine's own figures,
        for refusing a message before it is stored."""
        return len(self.engine.prepare(request).tokens), self.engine.prompts.limit(request)

    def release_session(self, session: str) -> None:
        self.engine.release_session(session)

    def forget_session(self, session: str) -> None:
        self.engine.forget_session(session)

    def close(self) -> None:
        """Close the engine, or give a pooled one back to its pool, which keeps it loaded."""
        if self._models is None:
            self.engine.close()
        elif not self._released:
            self._released = True
            self._models.pool.release(self._entry)


@dataclass
class _RemoteState:
    cancelled: bool = False
    response: httpx.Response | None = None


class RemoteHandle:
    """One streamed chat completion over HTTP. Iterating it performs the request (in the caller's thread)."""

    def __init__(self, client: RemoteClient, request: ChatRequest):
        self._client = client
        self._request = request
        self._lock = threading.Lock()
        self._state = _RemoteState()

    def cancel(self) -> None:
        with self._lock:
            self._state.cancelled = True
            response = self._state.response
        if response is not None:
            # Closing the stream makes the blocked read in __iter__ end promptly.
            try:
                response.close()
            except Exception:  # noqa: BLE001 - the response may already be closed by the reader
                pass

    def __iter__(self) -> Iterator[Event]:
        import httpx

        from edgechat.openai_stream import iter_chunks

        req = self._request
        body = self._client.body(req)
        metrics = RequestMetrics(context_size=self._client.n_ctx or 0)
        parts: list[str] = []
        thoughts: list[str] = []
        #: stays None unless the server says the answer ended (a finish reason, or an error)
        reason = None
        error = None
        start = time.perf_counter()
        first = None
        n_chunks = 0
        try:
            with self._client.http.stream("POST", "/v1/chat/completions", json=body) as response:
                with self._lock:
                    self._state.response = response
                    cancelled = self._state.cancelled
                if response.status_code >= 400:
                    response.read()
                    raise EdgechatError(f"server answered {response.status_code}: {_error_text(response)}")
                if not cancelled:
                    # an error event mid-answer raises StreamError (an EdgechatError): what came is partial
                    for chunk in iter_chunks(response):
                        if chunk.usage:
                            metrics.prompt_tokens = chunk.usage.get("prompt_tokens", 0)
                            metrics.completion_tokens = chunk.usage.get("completion_tokens", 0)
                            details = chunk.usage.get("completion_tokens_details") or {}
                            metrics.reasoning_tokens = details.get("reasoning_tokens") or 0
                        if chunk.reasoning:
                            # another server's thoughts (reasoning_content, or reasoning): shown apart
                            if first is None:
                                first = time.perf_counter()
                            n_chunks += 1
                            thoughts.append(chunk.reasoning)
                            yield TextDelta(chunk.reasoning, reasoning=True)
                        if chunk.text:
                            if first is None:
                                first = time.perf_counter()
                            n_chunks += 1
                            parts.append(chunk.text)
                            yield TextDelta(chunk.text)
                        if chunk.finish_reason:
                            reason = chunk.finish_reason
        except (httpx.HTTPError, EdgechatError) as exc:
            if not self._state.cancelled:
                reason, error = "error", str(exc) or type(exc).__name__
        if self._state.cancelled:
            reason = "cancelled"
        elif reason is None:
            reason, error = "error", "the server closed the stream before the answer ended"
        end = time.perf_counter()
        metrics.total = end - start
        if first is not None:
            metrics.ttft = first - start
            metrics.decode = end - first
        metrics.completion_tokens = metrics.completion_tokens or n_chunks
        metrics.context_tokens = metrics.prompt_tokens + metrics.completion_tokens
        yield Metrics(metrics)
        yield Finished(reason=reason, text="".join(parts), metrics=metrics, error=error, reasoning="".join(thoughts))


def _wire_message(message: dict) -> dict:
    """A message as OpenAI's API takes it: a content of parts with pictures becomes text and
    `image_url` parts, each picture a data URL (the bytes go with the request: nothing is fetched)."""
    from edgechat.engine.types.request import ImageInput

    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        if isinstance(part, ImageInput):
            url = f"data:{part.media_type or 'application/octet-stream'};base64,{base64.b64encode(part.data).decode()}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": part})
    return {**message, "content": parts}


def _error_text(response) -> str:
    from edgechat.openai_stream import error_message

    try:
        return error_message(response.json())
    except ValueError:
        return response.text[:200]


class RemoteClient:
    """Any OpenAI-compatible server (edgechat serve, llama-server, Ollama): /v1/models, /v1/chat/completions."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 10.0):
        import httpx

        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--url must start with http:// or https:// (got {url})")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: a slow model may think for a long time between tokens.
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(timeout, read=None))
        self.url = url
        self.backend = f"remote {url}"
        self.template_mode = "chat"
        self.template_warning: str | None = None
        self.n_ctx: int | None = None
        models = self.list_models()
        if model is None:
            if not models:
                raise ModelNotFoundError(f"the server at {url} lists no models; pass one with -m")
            model = models[0]
        self.model_name = model
        self.tool_family: object | None = None
        self.image_refusal: str | None = None

    def list_models(self) -> list[str]:
        import httpx

        try:
            response = self.http.get("/v1/models")
            response.raise_for_status()
            return [m["id"] for m in response.json().get("data", [])]
        except httpx.HTTPStatusError as exc:
            raise EdgechatError(f"{self.url} answered {exc.response.status_code} to /v1/models") from None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise EdgechatError(f"cannot reach an OpenAI-compatible server at {self.url}: {exc}") from None

    def body(self, req: ChatRequest) -> dict:
        s = req.sampling
        body = {
            "model": self.model_name,
            "messages": [_wire_message(m) for m in req.messages or ()],
            "stream": True,
            "stream_options": {"include_usage": True},
            # every sampler setting, so a server answers as the local engine would (names as llama-server's)
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": s.min_p,
            "repeat_penalty": s.repeat_penalty,
            "repeat_last_n": s.penalty_last_n,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
        }
        if req.max_tokens is not None:
            body["max_tokens"] = req.max_tokens
        if s.seed is not None:
            body["seed"] = s.seed
        if not req.loop_guard:
            body["loop_guard"] = False  # edgechat's own field: other servers ignore it
        if req.stop:
            body["stop"] = req.stop
        if req.speculative not in (None, "auto"):
            # edgechat serve's own field; other servers are sent it only when a conversation asks
            body["speculative"] = req.speculative.value
        kwargs = dict(req.template_kwargs)
        if req.reasoning_budget is not None:
            # sent only when a conversation limits thinking (edgechat serve's field; off is also
            # the template switch llama-server and vLLM pass to Qwen3-style templates)
            body["reasoning_budget"] = req.reasoning_budget
            if req.reasoning_budget == 0:
                kwargs.setdefault("enable_thinking", False)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        return body

    def submit(self, request: ChatRequest) -> Handle:
        if not request.messages:
            raise UsageError("remote mode sends chat messages; the request has none")
        return RemoteHandle(self, request)

    def release_session(self, session: str) -> None:
        """Servers keep no per-conversation state we could release."""

    def forget_session(self, session: str) -> None:
        """Nothing to forget on the server either."""

    def close(self) -> None:
        self.http.close()
