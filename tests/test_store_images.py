"""Pictures in the conversation store: migration m006 on a database that predates it, files named
by their sha256 under the data directory's images/, removed once no message names them, kept
through branch, export and the undo of a delete, and given back to the engine as ImageInput parts."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest
from tiny_mmproj import CHECKS, GRADIENT

from edgechat.engine import ImageInput
from edgechat.errors import StoreError
from edgechat.store import Store, migrate, open_store
from edgechat.store.history import model_messages
from edgechat.store.migrations import MIGRATIONS, applied


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def store(isolated_dirs):
    s = open_store(isolated_dirs)
    yield s
    s.close()


def files(store: Store) -> set[str]:
    return {p.name for p in store.images.iterdir()} if store.images.exists() else set()


def test_the_migration_adds_the_table_to_a_database_that_predates_it(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    migrate(db, MIGRATIONS[:5])  # as the app left it before m006
    db.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES ('c1', 'Old', 0, 0)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES ('c1', 'user', 'hello', 0)")
    db.close()

    store = Store.connect(path)
    assert applied(store.db)[-1] == "m006_message_images"
    old = store.messages("c1")
    assert [(m.content, m.images) for m in old] == [("hello", [])]
    assert model_messages(store, "c1") == [{"role": "user", "content": "hello"}]
    # and the old conversation takes pictures now, beside the database
    store.add_message("c1", "user", "and this?", images=[ImageInput(GRADIENT, "image/png")])
    assert (tmp_path / "images" / sha(GRADIENT)).read_bytes() == GRADIENT
    assert migrate(store.db) == []  # re-running does nothing
    store.close()


def test_pictures_are_files_named_by_their_hash_one_for_every_message_that_sends_it(store):
    conv = store.create_conversation()
    first = store.add_message(conv.id, "user", "look", images=[ImageInput(GRADIENT, "image/png"), ImageInput(CHECKS, "image/png")])
    store.add_message(conv.id, "user", "again", images=[ImageInput(GRADIENT, "image/png")])
    assert files(store) == {sha(GRADIENT), sha(CHECKS)}  # no temp files left, one file per picture
    stored = store.get_message(first.id).images
    assert [(i.sha256, i.media_type, i.bytes) for i in stored] == [
        (sha(GRADIENT), "image/png", len(GRADIENT)), (sha(CHECKS), "image/png", len(CHECKS))]
    assert [store.image_data(i) for i in stored] == [GRADIENT, CHECKS]
    assert first.images == stored  # add_message says what it stored
    rows = store.db.execute("SELECT message_id, position, sha256 FROM message_images ORDER BY rowid").fetchall()
    assert [tuple(r) for r in rows] == [(first.id, 0, sha(GRADIENT)), (first.id, 1, sha(CHECKS)), (first.id + 1, 0, sha(GRADIENT))]


def test_deleting_removes_only_the_files_no_message_names_any_more(store):
    conv = store.create_conversation()
    keep = store.add_message(conv.id, "user", "one", images=[ImageInput(GRADIENT, "image/png")])
    store.add_message(conv.id, "user", "two", images=[ImageInput(GRADIENT, "image/png"), ImageInput(CHECKS, "image/png")])
    other = store.create_conversation()
    store.add_message(other.id, "user", "mine too", images=[ImageInput(CHECKS, "image/png")])

    store.delete_messages_from(conv.id, keep.id + 1)
    assert files(store) == {sha(GRADIENT), sha(CHECKS)}  # both still named
    store.delete_conversation(other.id)
    assert files(store) == {sha(GRADIENT)}
    store.delete_conversation(conv.id)
    assert files(store) == set()
    assert store.db.execute("SELECT count(*) FROM message_images").fetchone()[0] == 0


def test_history_gives_the_pictures_back_as_image_parts_before_the_text(store):
    conv = store.create_conversation()
    user, answer = store.add_turn(conv.id, "What is in this picture?", images=[ImageInput(GRADIENT, "image/png")])
    store.update_message(answer.id, content="Colours.", status="complete")
    store.add_message(conv.id, "user", "", images=[ImageInput(CHECKS, "image/png")])  # a picture alone
    history = model_messages(store, conv.id)
    assert [m["role"] for m in history] == ["user", "assistant", "user"]
    (picture, text), reply, (alone,) = history[0]["content"], history[1]["content"], history[2]["content"]
    assert isinstance(picture, ImageInput) and (picture.data, picture.media_type) == (GRADIENT, "image/png")
    assert (text, reply) == ("What is in this picture?", "Colours.")
    assert alone.data == CHECKS


def test_branch_export_and_undo_keep_the_pictures(store):
    conv = store.create_conversation()
    first = store.add_message(conv.id, "user", "look", images=[ImageInput(GRADIENT, "image/png")])
    store.add_message(conv.id, "assistant", "ok")
    branch = store.branch(conv.id, first.id)
    assert [m.images[0].sha256 for m in store.messages(branch.id)] == [sha(GRADIENT)]

    saved = store.export_conversation(conv.id)  # what the chat app keeps for /undo
    store.delete_conversation(conv.id)
    assert files(store) == {sha(GRADIENT)}  # the branch still names it
    store.delete_conversation(branch.id)
    assert files(store) == set()
    store.import_conversation(saved)
    (back, _) = store.messages(conv.id)
    assert [store.image_data(i) for i in back.images] == [GRADIENT]


def test_a_missing_file_and_a_store_without_a_folder_are_one_line(store):
    conv = store.create_conversation()
    msg = store.add_message(conv.id, "user", "look", images=[ImageInput(GRADIENT, "image/png")])
    (store.images / sha(GRADIENT)).unlink()
    with pytest.raises(StoreError, match="cannot read a picture"):
        model_messages(store, conv.id)
    assert store.export_conversation(conv.id)["messages"][0]["images"] == []  # the undo of a delete still works
    memory = Store.connect(":memory:")
    other = memory.create_conversation()
    with pytest.raises(StoreError, match="keeps no pictures"):
        memory.add_message(other.id, "user", "x", images=[ImageInput(GRADIENT, "image/png")])
    assert memory.messages(other.id) == []  # nothing half-stored
    assert store.get_message(msg.id) is not None
