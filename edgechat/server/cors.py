"""CORS for browser clients (`serve --cors-origins`): Starlette's middleware, outside the API-key
check, so a browser's preflight (which never carries the key) is answered, not refused."""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from edgechat.server.errors import ApiError


class Cors(CORSMiddleware):
    """Responses to the allowed origins (`*`: any) carry CORS headers; a preflight from one is a
    204, one from any other origin a 400 in the shape of the API the path belongs to, and other
    origins' responses get no CORS headers."""

    def __init__(self, app, origins: tuple[str, ...], render: Callable[[str, ApiError], Response]):
        # any header: browser SDKs send their own (x-stainless-*, anthropic-version) besides
        # Authorization, x-api-key and Content-Type; an allowed page on the public web may call
        # this server on localhost (Chrome's private network preflight)
        super().__init__(app, allow_origins=origins, allow_methods=["*"], allow_headers=["*"], allow_private_network=True)
        self.render = render

    async def __call__(self, scope, receive, send):
        headers = Headers(scope=scope) if scope["type"] == "http" else None
        if headers is None or scope["method"] != "OPTIONS" or "origin" not in headers or "access-control-request-method" not in headers:
            await super().__call__(scope, receive, send)
            return
        allowed = self.preflight_response(headers)
        if allowed.status_code == 200:
            cors = {k: v for k, v in allowed.headers.items() if k.lower().startswith("access-control-") or k.lower() == "vary"}
            response = Response(status_code=204, headers=cors)
        elif not self.is_allowed_origin(headers["origin"]):
            message = f"CORS: the origin {headers['origin'][:100]!r} is not allowed; start the server with --cors-origins naming it"
            response = self.render(scope["path"], ApiError(403, message, code="cors_origin_not_allowed"))
        else:
            method = headers["access-control-request-method"][:20]
            response = self.render(scope["path"], ApiError(400, f"CORS: {method!r} is not an HTTP method", code="invalid_value"))
        await response(scope, receive, send)
