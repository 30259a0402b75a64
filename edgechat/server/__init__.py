"""The OpenAI-compatible HTTP server: `create_app(settings, engine)` and its settings."""

from edgechat.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name: str):
    # the app pulls in Starlette; the CLI needs only the settings' defaults to build its options
    if name == "create_app":
        from edgechat.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
