"""The conversation store: SQLite in WAL mode, every write committed at once."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from edgechat.config import Paths, make_data_dir
from edgechat.engine.types.request import ImageInput
from edgechat.errors import StoreError
from edgechat.fsutil import atomic_write
from edgechat.store.migrations import migrate

DEFAULT_TITLE = "New chat"
MESSAGE_STATUSES = ("complete", "interrupted", "error")
_TITLE_CHARS = 60
#: pages one commit of a message may write besides its text (table, index, FTS and WAL frames);
#: the text itself goes into the table, its search index and the WAL: three times its size
_COMMIT_PAGES = 16
#: the folder beside the database that holds the messages' pictures, one file per sha256
IMAGES_DIR = "images"


class ImageLike(Protocol):
    """What a message's picture is given as (engine.ImageInput, attachments.ImageAttachment)."""

    @property
    def data(self) -> bytes: ...

    @property
    def media_type(self) -> str | None: ...


@dataclass(frozen=True)
class StoredImage:
    """A picture a message was sent with: its file is IMAGES_DIR/sha256 (Store.image_data)."""

    sha256: str
    media_type: str | None
    bytes: int


@dataclass
class Conversation:
    id: str
    name: str | None
    title: str
    model: str | None
    settings: dict = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    parent_id: str | None = None
    parent_message_id: int | None = None


@dataclass
class Message:
    id: int
    conversation_id: str
    role: str
    content: str
    status: str = "complete"
    #: answer stats and the like: ttft, tok/s, finish reason, model
    meta: dict = field(default_factory=dict)
    created_at: float = 0.0
    #: a reasoning model's thoughts before the answer ("" for none): shown and exported, never sent again
    reasoning: str = ""
    #: the tool calls the answer made, each {id, server, name, arguments (JSON text), outcome
    #: ("ok", "error", "denied", "stopped"), result (what the model was given back)}
    tool_calls: list = field(default_factory=list)
    #: the pictures sent with it, in order (the model reads them before the text)
    images: list[StoredImage] = field(default_factory=list)


class SearchHit(NamedTuple):
    conversation: Conversation
    message: Message
    #: the matching words in context, matches wrapped in [ and ]
    snippet: str


def image_names(message: Message) -> list[str]:
    """What to call each of a message's pictures: the file names the chat app stored in its
    meta, else "image 1", "image 2"... (a turn stored by `edgechat run --session`)."""
    given = [i.get("name") for i in message.meta.get("images") or ()]
    return [given[k] if k < len(given) and given[k] else f"image {k + 1}" for k in range(len(message.images))]


def title_from(text: str) -> str:
    """A conversation title from its first message: first non-empty line, shortened at a word."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not line:
        return DEFAULT_TITLE
    if len(line) <= _TITLE_CHARS:
        return line
    cut = line[:_TITLE_CHARS].rsplit(" ", 1)[0] or line[:_TITLE_CHARS]
    return cut.rstrip(" ,.;:") + "…"


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        id=row["id"],
        name=row["name"],
        title=row["title"],
        model=row["model"],
        settings=json.loads(row["settings"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        parent_id=row["parent_id"],
        parent_message_id=row["parent_message_id"],
    )


def _message(row: sqlite3.Row) -> Message:
    return Message(
        id=row["id"],
        conversation_id=row["conversation_id"],
        role=row["role"],
        content=row["content"],
        status=row["status"],
        meta=json.loads(row["meta"]),
        created_at=row["created_at"],
        reasoning=row["reasoning"],
        tool_calls=json.loads(row["tool_calls"]),
    )


class Store:
    """Conversations and their messages. Safe to share between threads (one lock, short writes).

    A write that fails for want of room raises StoreError with one line that says so."""

    def __init__(self, db: sqlite3.Connection, path: Path | None = None, images: Path | None = None):
        self.db = db
        #: the database file (None in memory): a failed write names the disk that holds it
        self.path = path
        #: where the pictures' files are (None: this store keeps no pictures)
        self.images = images if images is not None or path is None else path.parent / IMAGES_DIR
        self._lock = threading.RLock()

    # -- lifecycle ---------------------------------------------------------

    @classmethod
    def connect(cls, path: str | Path, images: Path | None = None) -> Store:
        """Open (creating if needed) and migrate a database; ':memory:' for tests. `images`: the
        pictures' folder (default: IMAGES_DIR beside the database; none for ':memory:')."""
        if str(path) != ":memory:":
            _make_private(Path(path))
        try:
            # isolation_level=None: autocommit, so each write is on disk when the call returns.
            db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10)
            db.row_factory = sqlite3.Row
            if str(path) != ":memory:":
                _enable_wal(db)
                # NORMAL under WAL survives a killed process; only power loss can drop the last commit.
                db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            migrate(db)
        except sqlite3.DatabaseError as exc:
            # opening writes too (the WAL and its shared-memory index, migrations)
            room = _room_error(Path(path), exc, _COMMIT_PAGES * 4096) if str(path) != ":memory:" else None
            raise room or StoreError(f"cannot open the conversation store {path}: {exc}") from None
        return cls(db, None if str(path) == ":memory:" else Path(path), images)

    def close(self) -> None:
        with self._lock:
            self.db.close()

    def _tx(self, size: int = 0):
        """One write transaction; `size` is roughly how many bytes of text it stores (for the
        room a disk-full error says is needed)."""
        return _Transaction(self, size)

    def write_error(self, exc: sqlite3.DatabaseError, size: int = 0) -> StoreError | None:
        """The one line for a write that failed for want of room, or None for any other failure."""
        try:
            page = self.db.execute("PRAGMA page_size").fetchone()[0]
        except sqlite3.DatabaseError:
            page = 4096
        return _room_error(self.path, exc, 3 * size + _COMMIT_PAGES * page)

    # -- conversations -----------------------------------------------------

    def create_conversation(
        self,
        title: str = DEFAULT_TITLE,
        model: str | None = None,
        settings: dict | None = None,
        name: str | None = None,
        *,
        parent_id: str | None = None,
        parent_message_id: int | None = None,
        id: str | None = None,
    ) -> Conversation:
        now = time.time()
        conv = Conversation(
            id=id or secrets.token_hex(6),
            name=name,
            title=title,
            model=model,
            settings=dict(settings or {}),
            created_at=now,
            updated_at=now,
            parent_id=parent_id,
            parent_message_id=parent_message_id,
        )
        with self._tx() as db:
            try:
                db.execute(
                    "INSERT INTO conversations (id, name, title, model, settings, created_at, updated_at,"
                    " parent_id, parent_message_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (conv.id, name, title, model, json.dumps(conv.settings), now, now, parent_id, parent_message_id),
                )
            except sqlite3.IntegrityError:
                raise StoreError(f"a conversation named '{name}' already exists") from None
        return conv

    def get_conversation(self, conv_id: str) -> Conversation | None:
        with self._lock:
            row = self.db.execute("SELECT * FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        return _conversation(row) if row else None

    def _existing(self, conv_id: str) -> Conversation:
        """A conversation this store has just written or read a row of."""
        conv = self.get_conversation(conv_id)
        if conv is None:
            raise StoreError(f"no conversation with id {conv_id}")
        return conv

    def conversation_by_name(self, name: str, create: bool = True) -> Conversation | None:
        with self._lock:
            row = self.db.execute("SELECT * FROM conversations WHERE name = ?", (name,)).fetchone()
            if row:
                return _conversation(row)
            return self.create_conversation(title=name, name=name) if create else None

    def find_conversations(self, ref: str) -> list[Conversation]:
        """The conversations `ref` names, by id or by name: one namespace for every front end.
        More than one means a stored name equals another conversation's id."""
        with self._lock:
            rows = self.db.execute(
                "SELECT * FROM conversations WHERE id = ? OR name = ? ORDER BY created_at, rowid", (ref, ref)
            ).fetchall()
        return [_conversation(r) for r in rows]

    def rename_conversation(self, conv_id: str, name: str | None) -> None:
        """Give a conversation a name (None takes it away); a name is never another one's id or name."""
        with self._tx() as db:
            taken = db.execute(
                "SELECT 1 FROM conversations WHERE (id = ? OR name = ?) AND id != ?", (name, name, conv_id)
            ).fetchone()
            if taken:
                raise StoreError(f"'{name}' already names another conversation")
            if db.execute("UPDATE conversations SET name = ? WHERE id = ?", (name, conv_id)).rowcount == 0:
                raise StoreError(f"no conversation with id {conv_id}")

    def list_conversations(self) -> list[Conversation]:
        """Most recently updated first."""
        with self._lock:
            rows = self.db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, rowid DESC").fetchall()
        return [_conversation(r) for r in rows]

    def update_conversation(
        self,
        conv_id: str,
        title: str | None = None,
        settings: dict | None = None,
        model: str | None = None,
    ) -> Conversation:
        sets = ["updated_at = ?"]
        args: list[str | float] = [time.time()]
        if title is not None:
            sets.append("title = ?")
            args.append(title.strip() or DEFAULT_TITLE)
        if settings is not None:
            sets.append("settings = ?")
            args.append(json.dumps(settings))
        if model is not None:
            sets.append("model = ?")
            args.append(model)
        with self._tx() as db:
            cur = db.execute(f"UPDATE conversations SET {', '.join(sets)} WHERE id = ?", (*args, conv_id))
            if cur.rowcount == 0:
                raise StoreError(f"no conversation with id {conv_id}")
        return self._existing(conv_id)

    def delete_conversation(self, conv_id: str) -> None:
        with self._tx() as db:
            hashes = self._image_hashes(db, "m.conversation_id = ?", (conv_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))
            self._sweep(db, hashes)

    # -- messages ----------------------------------------------------------

    def messages(self, conv_id: str, limit: int | None = None, before: int | None = None) -> list[Message]:
        """Oldest first; with `limit`, only the newest `limit` (of those with id < `before`, if given)."""
        where = "conversation_id = ?"
        args: list[str | int] = [conv_id]
        if before is not None:
            where += " AND id < ?"
            args.append(before)
        with self._lock:
            if limit is None:
                rows = self.db.execute(f"SELECT * FROM messages WHERE {where} ORDER BY id", args).fetchall()
            else:
                rows = self.db.execute(
                    f"SELECT * FROM (SELECT * FROM messages WHERE {where} ORDER BY id DESC LIMIT ?) ORDER BY id",
                    (*args, limit),
                ).fetchall()
            return self._with_images([_message(r) for r in rows])

    def count_messages(self, conv_id: str, before: int | None = None) -> int:
        sql = "SELECT count(*) FROM messages WHERE conversation_id = ?"
        args: list[str | int] = [conv_id]
        if before is not None:
            sql += " AND id < ?"
            args.append(before)
        with self._lock:
            return self.db.execute(sql, args).fetchone()[0]

    def get_message(self, msg_id: int) -> Message | None:
        with self._lock:
            row = self.db.execute("SELECT * FROM messages WHERE id = ?", (msg_id,)).fetchone()
            return self._with_images([_message(row)])[0] if row else None

    # -- pictures ----------------------------------------------------------

    def _with_images(self, messages: list[Message]) -> list[Message]:
        """`messages` (one conversation's run of ids) with their pictures filled in: one query."""
        if not messages:
            return messages
        by_id = {m.id: m for m in messages}
        rows = self.db.execute(
            "SELECT * FROM message_images WHERE message_id BETWEEN ? AND ? ORDER BY message_id, position",
            (min(by_id), max(by_id)),
        ).fetchall()
        for row in rows:
            if row["message_id"] in by_id:
                by_id[row["message_id"]].images.append(StoredImage(row["sha256"], row["media_type"], row["bytes"]))
        return messages

    def image_data(self, image: StoredImage) -> bytes:
        """A stored picture's bytes; StoreError (one line) when its file is gone."""
        if self.images is None:
            raise StoreError("this conversation store keeps no pictures")
        try:
            return (self.images / image.sha256).read_bytes()
        except OSError as exc:
            raise StoreError(f"cannot read a picture of this conversation ({self.images / image.sha256}: "
                             f"{exc.strerror}); it may have been deleted by hand") from None

    def _put_images(self, db: sqlite3.Connection, msg_id: int, images: Sequence[ImageLike]) -> None:
        """Store `images` as `msg_id`'s, in order, inside the caller's write transaction: the
        files are written (temp file, then rename) while the write lock is held, so a store
        sweeping files no longer named (another process deleting a conversation) never removes
        one between its write and the row that names it."""
        if images and self.images is None:
            raise StoreError("this conversation store keeps no pictures")
        for position, image in enumerate(images):
            digest = hashlib.sha256(image.data).hexdigest()
            assert self.images is not None
            target = self.images / digest
            if not target.is_file():
                try:
                    self.images.mkdir(mode=0o700, parents=True, exist_ok=True)
                    atomic_write(target, [image.data])
                except OSError as exc:
                    raise StoreError(f"cannot store the picture in {self.images}: {exc.strerror}") from None
            db.execute(
                "INSERT INTO message_images (message_id, position, sha256, media_type, bytes) VALUES (?, ?, ?, ?, ?)",
                (msg_id, position, digest, image.media_type, len(image.data)),
            )

    @staticmethod
    def _image_hashes(db: sqlite3.Connection, where: str, args: tuple) -> set[str]:
        """The pictures of the messages `where` selects (as `m`), before they are deleted."""
        rows = db.execute(
            f"SELECT DISTINCT i.sha256 FROM message_images i JOIN messages m ON m.id = i.message_id WHERE {where}", args
        ).fetchall()
        return {row[0] for row in rows}

    def _sweep(self, db: sqlite3.Connection, hashes: Iterable[str]) -> None:
        """Remove the files of `hashes` that no message names any more (in the deleting
        transaction, under the write lock: see _put_images)."""
        for digest in hashes:
            if self.images is not None and db.execute(
                "SELECT 1 FROM message_images WHERE sha256 = ? LIMIT 1", (digest,)
            ).fetchone() is None:
                (self.images / digest).unlink(missing_ok=True)

    def add_message(
        self, conv_id: str, role: str, content: str, status: str = "complete", meta: dict | None = None,
        images: Sequence[ImageLike] = (),
    ) -> Message:
        """Store a message now (with `images`, the pictures sent with it). The first user
        message of an untitled conversation titles it."""
        if status not in MESSAGE_STATUSES:
            raise ValueError(f"unknown message status {status!r}")
        now = time.time()
        # (the size a full disk's error counts three times, as text is written: a picture's bytes are written once)
        with self._tx(len(content.encode()) + sum(len(i.data) for i in images) // 3) as db:
            conv = db.execute("SELECT title FROM conversations WHERE id = ?", (conv_id,)).fetchone()
            if conv is None:
                raise StoreError(f"no conversation with id {conv_id}")
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, status, meta, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (conv_id, role, content, status, json.dumps(meta or {}), now),
            )
            self._put_images(db, cur.lastrowid, images)
            if role == "user" and conv["title"] == DEFAULT_TITLE:
                first = db.execute(
                    "SELECT count(*) FROM messages WHERE conversation_id = ? AND role = 'user'", (conv_id,)
                ).fetchone()[0]
                if first == 1:
                    db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title_from(content), conv_id))
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conv_id))
        stored = [StoredImage(hashlib.sha256(i.data).hexdigest(), i.media_type, len(i.data)) for i in images]
        return Message(cur.lastrowid, conv_id, role, content, status, dict(meta or {}), now, images=stored)

    def add_turn(self, conv_id: str, question: str, meta: dict | None = None,
                 images: Sequence[ImageLike] = ()) -> tuple[Message, Message]:
        """A question and its answer-to-be, stored together or not at all. The answer starts empty
        and "interrupted": a process killed before the answer ends leaves it marked, and a
        question whose answer never got any text is left out of later prompts (history.py)."""
        with self._tx(len(question.encode())):
            user = self.add_message(conv_id, "user", question, images=images)
            answer = self.add_message(conv_id, "assistant", "", status="interrupted", meta=meta)
        return user, answer

    def update_message(
        self,
        msg_id: int,
        content: str | None = None,
        status: str | None = None,
        meta: dict | None = None,
        reasoning: str | None = None,
        tool_calls: list | None = None,
    ) -> None:
        """Change an answer as it streams or ends; `meta` is merged into what is there."""
        if status is not None and status not in MESSAGE_STATUSES:
            raise ValueError(f"unknown message status {status!r}")
        size = len(content.encode()) if content else 0
        with self._tx(size + (len(reasoning.encode()) if reasoning else 0)) as db:
            row = db.execute("SELECT meta FROM messages WHERE id = ?", (msg_id,)).fetchone()
            if row is None:
                raise StoreError(f"no message with id {msg_id}")
            if content is not None:
                db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, msg_id))
            if status is not None:
                db.execute("UPDATE messages SET status = ? WHERE id = ?", (status, msg_id))
            if reasoning is not None:
                db.execute("UPDATE messages SET reasoning = ? WHERE id = ?", (reasoning, msg_id))
            if tool_calls is not None:
                db.execute("UPDATE messages SET tool_calls = ? WHERE id = ?", (json.dumps(tool_calls), msg_id))
            if meta is not None:
                merged = {**json.loads(row["meta"]), **meta}
                db.execute("UPDATE messages SET meta = ? WHERE id = ?", (json.dumps(merged), msg_id))

    def delete_messages_from(self, conv_id: str, msg_id: int) -> int:
        """Drop a message and everything after it (regenerate, edit and resend); returns how many."""
        with self._tx() as db:
            hashes = self._image_hashes(db, "m.conversation_id = ? AND m.id >= ?", (conv_id, msg_id))
            n = db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conv_id, msg_id)).rowcount
            self._sweep(db, hashes)
            return n

    # -- search, branch, export/import ------------------------------------

    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Full-text search over every message, best matches first. Words are matched as prefixes."""
        terms = [t.replace('"', '""') for t in query.split()]
        if not terms:
            return []
        # Each word quoted: the user's text is never FTS5 syntax (a stray '-' or ':' is not an error).
        fts_query = " ".join(f'"{t}"*' for t in terms)
        with self._lock:
            rows = self.db.execute(
                "SELECT m.*, snippet(messages_fts, 0, '[', ']', '…', 12) AS snip"
                " FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid"
                " WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?",
                (fts_query, limit),
            ).fetchall()
            hits = []
            convs: dict[str, Conversation] = {}
            for row in rows:
                cid = row["conversation_id"]
                if cid not in convs:
                    convs[cid] = self._existing(cid)
                hits.append(SearchHit(convs[cid], _message(row), row["snip"]))
        return hits

    def branch(self, conv_id: str, at_message_id: int) -> Conversation:
        """Fork: a new conversation with copies of the messages up to and including `at_message_id`."""
        src = self.get_conversation(conv_id)
        if src is None:
            raise StoreError(f"no conversation with id {conv_id}")
        with self._tx() as db:
            found = db.execute(
                "SELECT 1 FROM messages WHERE id = ? AND conversation_id = ?", (at_message_id, conv_id)
            ).fetchone()
            if not found:
                raise StoreError(f"message {at_message_id} is not in conversation {conv_id}")
            new = self.create_conversation(
                title=f"{src.title} (branch)",
                model=src.model,
                settings=src.settings,
                parent_id=conv_id,
                parent_message_id=at_message_id,
            )
            db.execute(
                "INSERT INTO messages (conversation_id, role, content, status, meta, created_at, reasoning, tool_calls)"
                " SELECT ?, role, content, status, meta, created_at, reasoning, tool_calls FROM messages"
                " WHERE conversation_id = ? AND id <= ? ORDER BY id",
                (new.id, conv_id, at_message_id),
            )
            # the copies name the same picture files (inserted in the originals' order: ids pair up)
            old = [r[0] for r in db.execute("SELECT id FROM messages WHERE conversation_id = ? AND id <= ? ORDER BY id",
                                            (conv_id, at_message_id))]
            copies = [r[0] for r in db.execute("SELECT id FROM messages WHERE conversation_id = ? ORDER BY id", (new.id,))]
            db.executemany(
                "INSERT INTO message_images (message_id, position, sha256, media_type, bytes)"
                " SELECT ?, position, sha256, media_type, bytes FROM message_images WHERE message_id = ?",
                list(zip(copies, old, strict=True)),
            )
        return new

    def export_conversation(self, conv_id: str) -> dict:
        """Everything about a conversation as plain JSON-able data (export, undo of a delete)."""
        conv = self.get_conversation(conv_id)
        if conv is None:
            raise StoreError(f"no conversation with id {conv_id}")
        return {
            "id": conv.id,
            "name": conv.name,
            "title": conv.title,
            "model": conv.model,
            "settings": conv.settings,
            "created_at": conv.created_at,
            "updated_at": conv.updated_at,
            "parent_id": conv.parent_id,
            "parent_message_id": conv.parent_message_id,
            "messages": [
                {
                    "role": m.role,
                    "content": m.content,
                    "status": m.status,
                    "meta": m.meta,
                    "created_at": m.created_at,
                    # only an answer that thought has the field: other exports are as before
                    **({"reasoning": m.reasoning} if m.reasoning else {}),
                    **({"tool_calls": m.tool_calls} if m.tool_calls else {}),
                    **({"images": self._exported_images(m)} if m.images else {}),
                }
                for m in self.messages(conv_id)
            ],
        }

    def _exported_images(self, message: Message) -> list[dict]:
        """A message's pictures with their bytes: an export (and the undo of a delete) does not
        need the files. One whose file was deleted by hand is left out: there is nothing to carry."""
        out = []
        for image in message.images:
            try:
                data = self.image_data(image)
            except StoreError:
                continue
            out.append({"media_type": image.media_type, "data": base64.b64encode(data).decode()})
        return out

    def import_conversation(self, data: dict) -> Conversation:
        """Recreate a conversation from export_conversation() output, keeping its id and times."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO conversations (id, name, title, model, settings, created_at, updated_at,"
                " parent_id, parent_message_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    data["id"],
                    data.get("name"),
                    data["title"],
                    data.get("model"),
                    json.dumps(data.get("settings") or {}),
                    data["created_at"],
                    data["updated_at"],
                    data.get("parent_id"),
                    data.get("parent_message_id"),
                ),
            )
            for m in data["messages"]:
                cur = db.execute(
                    "INSERT INTO messages (conversation_id, role, content, status, meta, created_at, reasoning, tool_calls)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        data["id"],
                        m["role"],
                        m["content"],
                        m.get("status", "complete"),
                        json.dumps(m.get("meta") or {}),
                        m.get("created_at", data["created_at"]),
                        m.get("reasoning") or "",
                        json.dumps(m.get("tool_calls") or []),
                    ),
                )
                self._put_images(db, cur.lastrowid, [ImageInput(base64.b64decode(i["data"]), i.get("media_type"))
                                                     for i in m.get("images") or ()])
        return self._existing(data["id"])


def _room_error(path: Path | None, exc: sqlite3.DatabaseError, needed: int) -> StoreError | None:
    """One line for a failed write of about `needed` bytes, or None when it was not an I/O failure.

    SQLite says "database or disk is full" when a write hits ENOSPC, but "disk I/O error" when
    the disk is so full that even its shared-memory file cannot grow: either is the disk being
    full when the room left where the database lives is less than the write needs."""
    name = getattr(exc, "sqlite_errorname", "")  # Python 3.11+
    text = str(exc)
    if not (name.startswith(("SQLITE_FULL", "SQLITE_IOERR")) or "disk is full" in text or "disk I/O error" in text):
        return None
    where = path.parent if path is not None else Path.cwd()
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = 0
    if free >= needed:
        return StoreError(f"cannot write the conversation store {path}: {text}")
    return StoreError(
        f"the disk holding {where} is full ({free // 1024} KB free, about {-(-needed // 1024)} KB needed);"
        " free some space and retry"
    )


def _make_private(path: Path) -> None:
    """Create the database file (or take an existing one) as 0600 before SQLite opens it: SQLite
    would create it through the umask, and gives its -wal and -shm files the database's mode."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot open the conversation store {path}: {exc.strerror}") from None


class _Transaction:
    """`with store._tx() as db:` one BEGIN IMMEDIATE ... COMMIT under the store lock (re-entrant).
    A write that fails for want of room is rolled back and raised as a one-line StoreError."""

    def __init__(self, store: Store, size: int = 0):
        self.store = store
        self.size = size
        self.outer = False

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.acquire()
        db = self.store.db
        self.outer = not db.in_transaction
        if self.outer:
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.DatabaseError as exc:
                self.store._lock.release()
                raise self.store.write_error(exc, self.size) or exc from None
        return db

    def __exit__(self, exc_type, exc, tb) -> None:
        db = self.store.db
        try:
            if not self.outer:
                return
            if exc_type is None:
                try:
                    db.execute("COMMIT")
                    return
                except sqlite3.DatabaseError as commit_exc:
                    exc = commit_exc
            # SQLite may already have rolled back on a full disk; a failed COMMIT leaves it open.
            if db.in_transaction:
                db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.DatabaseError):
                error = self.store.write_error(exc, self.size)
                if error is not None:
                    raise error from None
                if exc_type is None:
                    raise exc
        finally:
            self.store._lock.release()


def open_store(paths: Paths) -> Store:
    """The user's conversation store under paths.data, created and migrated as needed."""
    try:
        make_data_dir(paths)
    except OSError as exc:
        raise StoreError(f"cannot create {paths.data}: {exc.strerror}") from None
    return Store.connect(paths.database)


def _enable_wal(db: sqlite3.Connection, wait: float = 10.0) -> None:
    """Switch a database to WAL. Two first runs at once both try it; SQLite answers "locked" at
    once instead of waiting when the switch would deadlock with the other's lock, so retry."""
    deadline = time.monotonic() + wait
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
