"""The OpenAI-compatible HTTP server: `create_app(settings, engine)` and its settings."""

from edgechat.server.app import create_app
from edgechat.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
