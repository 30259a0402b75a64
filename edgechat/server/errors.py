"""OpenAI-shaped errors: one exception type carries the status and the body every client expects."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from starlette.responses import JSONResponse, Response

from edgechat.errors import (
    EdgechatError,
    EngineBusyError,
    EngineStoppedError,
    InvalidFieldError,
    PromptTooLongError,
    UsageError,
)


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        tokens: tuple[int, int] | None = None,
    ):
        super().__init__(message)
        #: a prompt too long: its tokens and the most allowed (each API words this its own way)
        self.tokens = tokens
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def field_error(exc: InvalidFieldError) -> ApiError:
    """A bad field the engine's tool and schema code found, as the 400 naming it."""
    return bad_request(str(exc), param=exc.param, code=exc.code)


def prompt_too_long(prompt_tokens: int, limit: int, why: str) -> ApiError:
    # OpenAI's code and wording for this case: agents (Codex, opencode) match on the code and
    # compact or trim the conversation
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your messages resulted in {prompt_tokens} tokens "
        f"({why}). Please reduce the length of the messages.",
        param="messages",
        code="context_length_exceeded",
        tokens=(prompt_tokens, limit),
    )


def overloaded(retry_after: int) -> ApiError:
    return ApiError(
        429,
        "the server is at capacity: its request queue is full; retry later",
        type="rate_limit_exceeded",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


def from_engine_error(exc: EdgechatError, retry_after: int) -> ApiError:
    """Map the engine's typed user errors (raised by submit before any compute) to HTTP."""
    if isinstance(exc, PromptTooLongError):
        return prompt_too_long(exc.prompt_tokens, exc.limit, "the context window less the room for the answer")
    if isinstance(exc, EngineBusyError):
        return overloaded(retry_after)
    if isinstance(exc, InvalidFieldError):
        return field_error(exc)
    if isinstance(exc, UsageError):
        return bad_request(str(exc))
    if isinstance(exc, EngineStoppedError):
        # the pool loads a model whose engine stopped afresh for the next request: agents retry
        # a 503 with Retry-After (a model given to the server loaded stays stopped: see /health)
        return ApiError(503, str(exc), type="server_error", code="engine_stopped", headers={"Retry-After": "1"})
    return ApiError(500, str(exc), type="server_error", code="engine_error")


def answered_as(render: Callable[[ApiError], Response], usage_errors: bool = False):
    """A route method whose ApiErrors `render` answers (and UsageErrors, as 400s, with
    `usage_errors`): the shape of the API called, for routes the app's own handler (OpenAI's
    shape) would otherwise answer."""

    def wrap(handler):
        @functools.wraps(handler)
        async def wrapped(self, request) -> Response:
            try:
                return await handler(self, request)
            except ApiError as exc:
                return render(exc)
            except UsageError as exc:
                if not usage_errors:
                    raise
                return render(bad_request(str(exc)))

        return wrapped

    return wrap
