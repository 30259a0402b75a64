"""API-key authentication for every endpoint but /health, and each key's priority class."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers

from edgechat.server.errors import ApiError


class BearerAuth:
    """Pure ASGI middleware: every path but /health needs `Authorization: Bearer <key>`, the
    server's key or one of the keys given a priority class; the class goes into the request's
    state (`key_class`)."""

    def __init__(self, app, api_key: str | None, key_classes: dict[str, str] | None = None):
        self.app = app
        keys = {**({api_key: None} if api_key else {}), **(key_classes or {})}
        self.keys = [(k.encode(), cls) for k, cls in keys.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and scope["path"] != "/health":
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            given = token.strip().encode()
            # constant time, and every key compared: the timing must not tell a client how much
            # of its key was right, nor which key it was near
            matches = [cls for key, cls in self.keys if hmac.compare_digest(given, key)]
            if scheme.lower() != "bearer" or not matches:
                error = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
            scope.setdefault("state", {})["key_class"] = matches[0]
        await self.app(scope, receive, send)
