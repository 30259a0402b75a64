"""`edgechat` with no command: the chat app."""

from __future__ import annotations

from edgechat.config import get_paths


def open_app(model: str | None, url: str | None, api_key: str | None, data_dir: str | None,
             engine_options: dict | None = None) -> None:
    # Textual is imported here so that every other command starts without paying for it.
    from edgechat.tui.app import EdgechatApp

    app = EdgechatApp(get_paths(data_dir), model=model, url=url, api_key=api_key, engine_options=engine_options)
    try:
        app.run()
    finally:
        app.shutdown()
        app.store.close()
