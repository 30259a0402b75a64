"""Schema history of the conversation store: an append-only list of numbered migrations.

Never edit a migration that has shipped; add the next one. `migrate(db)` records each one it
applies in `_migrations`, so running it again on an up-to-date database does nothing.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable

Migration = Callable[[sqlite3.Connection], None]
MIGRATIONS: list[Migration] = []


def migration(func: Migration) -> Migration:
    MIGRATIONS.append(func)
    return func


@migration
def m001_initial(db: sqlite3.Connection) -> None:
    db.execute(
        """
        CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            name TEXT UNIQUE,
            title TEXT NOT NULL,
            model TEXT,
            settings TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )
        """
    )
    db.execute(
        """
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'complete',
            meta TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL
        )
        """
    )
    db.execute("CREATE INDEX messages_by_conversation ON messages(conversation_id, id)")
    db.execute("CREATE INDEX conversations_by_update ON conversations(updated_at)")


@migration
def m002_message_search(db: sqlite3.Connection) -> None:
    # External-content FTS5 index over messages.content, kept in step by triggers.
    db.execute("CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='id')")
    db.execute(
        """
        CREATE TRIGGER messages_ai AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END
        """
    )
    db.execute(
        """
        CREATE TRIGGER messages_ad AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        END
        """
    )
    # Only content changes touch the index: streaming updates of status/meta stay cheap.
    db.execute(
        """
        CREATE TRIGGER messages_au AFTER UPDATE OF content ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END
        """
    )
    db.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")


@migration
def m003_branch_origin(db: sqlite3.Connection) -> None:
    # Where a branched conversation came from, so the sidebar can say so.
    db.execute("ALTER TABLE conversations ADD COLUMN parent_id TEXT")
    db.execute("ALTER TABLE conversations ADD COLUMN parent_message_id INTEGER")


@migration
def m004_message_reasoning(db: sqlite3.Connection) -> None:
    # A reasoning model's thoughts, kept apart from the answer (not searched, never sent again).
    db.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")


@migration
def m005_message_tool_calls(db: sqlite3.Connection) -> None:
    # The tool calls an answer made, each with what came back (a result, a refusal, an error):
    # a JSON list, shown with the answer, sent back to the model, exported.
    db.execute("ALTER TABLE messages ADD COLUMN tool_calls TEXT NOT NULL DEFAULT '[]'")


@migration
def m006_message_images(db: sqlite3.Connection) -> None:
    # The pictures a message was sent with, in order: their bytes are files named by their
    # sha256 under the data directory's images/ (one file however many messages send it), so
    # the database stays small and a file is removed once no row names it.
    db.execute(
        """
        CREATE TABLE message_images (
            message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            sha256 TEXT NOT NULL,
            media_type TEXT,
            bytes INTEGER NOT NULL,
            PRIMARY KEY (message_id, position)
        )
        """
    )
    db.execute("CREATE INDEX message_images_by_hash ON message_images(sha256)")


def applied(db: sqlite3.Connection) -> list[str]:
    db.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    return [row[0] for row in db.execute("SELECT name FROM _migrations ORDER BY rowid")]


def migrate(db: sqlite3.Connection, migrations: list[Migration] | None = None) -> list[str]:
    """Apply every migration not yet recorded, each in its own transaction; return the names applied.
    `migrations`: another database's own list (the server's stored responses) instead of MIGRATIONS.

    Another process may be migrating the same new database (two first runs at once): each
    migration takes the write lock first (BEGIN IMMEDIATE, waiting out the other's) and only then
    checks whether it was applied, so neither runs one twice."""
    done = set(applied(db))
    ran = []
    for func in MIGRATIONS if migrations is None else migrations:
        if func.__name__ in done:
            continue
        # Explicit BEGIN: the connection runs in autocommit mode, and a migration is all or nothing.
        db.execute("BEGIN IMMEDIATE")
        try:
            if db.execute("SELECT 1 FROM _migrations WHERE name = ?", (func.__name__,)).fetchone() is None:
                func(db)
                db.execute("INSERT INTO _migrations (name, applied_at) VALUES (?, ?)", (func.__name__, time.time()))
                ran.append(func.__name__)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    return ran
