"""Conversations on disk: SQLite (WAL, FTS5 search) under the data directory, schema by migrations."""

from edgechat.store.db import (
    DEFAULT_TITLE,
    Conversation,
    Message,
    SearchHit,
    Store,
    StoredImage,
    image_names,
    open_store,
    title_from,
)
from edgechat.store.export import atomic_write_text, export_conversation, to_markdown
from edgechat.store.migrations import MIGRATIONS, migrate

__all__ = [
    "DEFAULT_TITLE",
    "MIGRATIONS",
    "Conversation",
    "Message",
    "SearchHit",
    "Store",
    "StoredImage",
    "atomic_write_text",
    "export_conversation",
    "image_names",
    "migrate",
    "open_store",
    "title_from",
    "to_markdown",
]
