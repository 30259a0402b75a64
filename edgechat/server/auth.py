"""API-key authentication for every endpoint but /health, and each key's priority class."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import Response

from edgechat.server.errors import ApiError


class BearerAuth:
    """Pure ASGI middleware: every path but /health needs the server's key or one of the keys
    given a priority class, as `Authorization: Bearer <key>` or as `x-api-key: <key>` (the
    header Anthropic's clients send); the class goes into the request's state (`key_class`).
    `render` answers the refusal in the shape of the API the path belongs to."""

    def __init__(self, app, api_key: str | None, key_classes: dict[str, str] | None = None,
                 render: Callable[[str, ApiError], Response] | None = None):
        self.app = app
        keys = {**({api_key: None} if api_key else {}), **(key_classes or {})}
        self.keys = [(k.encode(), cls) for k, cls in keys.items()]
        self.render = render or (lambda path, error: error.response())

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and scope["path"] != "/health":
            headers = Headers(scope=scope)
            scheme, _, token = headers.get("authorization", "").partition(" ")
            given = headers["x-api-key"] if "x-api-key" in headers else token if scheme.lower() == "bearer" else None
            # constant time, and every key compared: the timing must not tell a client how much
            # of its key was right, nor which key it was near
            matches = [] if given is None else [cls for key, cls in self.keys if hmac.compare_digest(given.strip().encode(), key)]
            if not matches:
                error = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await self.render(scope["path"], error)(scope, receive, send)
                return
            scope.setdefault("state", {})["key_class"] = matches[0]
        await self.app(scope, receive, send)
