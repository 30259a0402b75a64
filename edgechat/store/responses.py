"""The server's stored responses (OpenAI's Responses API, `store`): SQLite in their own file under
the data directory, the newest KEEP kept.

Each row is one response's body and its context: the input items it answered, those of every
response before it included, so `previous_response_id` still continues a conversation whose first
responses were dropped from the store long ago.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time

from edgechat.config import Paths, make_data_dir
from edgechat.errors import StoreError
from edgechat.store.migrations import Migration, migrate

#: responses kept; storing one more drops the oldest
KEEP = 1000


def m001_responses(db: sqlite3.Connection) -> None:
    db.execute(
        """
        CREATE TABLE responses (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            id TEXT NOT NULL UNIQUE,
            body TEXT NOT NULL,
            context TEXT NOT NULL,
            created_at REAL NOT NULL
        )
        """
    )


#: this database's own schema history (append-only, as the conversation store's)
MIGRATIONS: list[Migration] = [m001_responses]


class ResponseStore:
    """Opened on first use (most servers never store a response); every call is one statement
    or one transaction, safe from any thread."""

    def __init__(self, paths: Paths, keep: int = KEEP):
        self.paths = paths
        self.path = paths.data / "responses.sqlite"
        self.keep = keep
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _open(self) -> sqlite3.Connection:
        if self._db is None:
            try:
                make_data_dir(self.paths)  # private (0700): the responses hold what clients said
                # isolation_level=None: autocommit; the one multi-statement write is an explicit transaction
                db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=10)
                migrate(db, MIGRATIONS)
            except (OSError, sqlite3.DatabaseError) as exc:
                raise StoreError(f"cannot open the response store {self.path}: {exc}") from None
            self._db = db
        return self._db

    def put(self, response_id: str, body: dict, context: list[dict]) -> None:
        """Store a response (or replace one of the same id) and drop what falls past the bound."""
        row = (response_id, json.dumps(body, ensure_ascii=False), json.dumps(context, ensure_ascii=False), time.time())
        with self._lock:
            db = self._open()
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.execute("INSERT OR REPLACE INTO responses (id, body, context, created_at) VALUES (?, ?, ?, ?)", row)
                    db.execute("DELETE FROM responses WHERE seq NOT IN (SELECT seq FROM responses ORDER BY seq DESC LIMIT ?)", (self.keep,))
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"cannot store response {response_id} in {self.path}: {exc}") from None

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        """(body, context) of a stored response, or None."""
        with self._lock:
            row = self._open().execute("SELECT body, context FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        """Whether there was such a response."""
        with self._lock:
            return self._open().execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
