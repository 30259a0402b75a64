"""API-key authentication for every endpoint but /health."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers

from edgechat.server.errors import ApiError


class BearerAuth:
    """Pure ASGI middleware: every path but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.api_key is not None and scope["path"] != "/health":
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            # constant time: the comparison must not tell a client how much of its key was right
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                error = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
