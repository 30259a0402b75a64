"""The conversation store: migrations, CRUD, search, branch, export, durability."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from edgechat.errors import StoreError
from edgechat.store import (
    DEFAULT_TITLE,
    MIGRATIONS,
    Store,
    atomic_write_text,
    export_conversation,
    migrate,
    open_store,
    title_from,
)
from edgechat.store import migrations as mig
from edgechat.store.history import model_messages, with_system_prompt


@pytest.fixture
def store():
    s = Store.connect(":memory:")
    yield s
    s.close()


def _db():
    return sqlite3.connect(":memory:", isolation_level=None)


def _columns(db, table):
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


# -- migrations -------------------------------------------------------------


def test_migrations_are_numbered_in_order_and_unique():
    names = [m.__name__ for m in MIGRATIONS]
    assert len(set(names)) == len(names)
    numbers = [int(re.match(r"m(\d{3})_\w+$", n).group(1)) for n in names]
    assert numbers == list(range(1, len(names) + 1))


def test_migrate_records_and_is_rerunnable():
    db = _db()
    assert migrate(db) == [m.__name__ for m in MIGRATIONS]
    assert migrate(db) == []
    assert mig.applied(db) == [m.__name__ for m in MIGRATIONS]


def test_m001_initial_creates_tables():
    db = _db()
    mig.m001_initial(db)
    assert {"id", "name", "title", "model", "settings", "created_at", "updated_at"} <= _columns(db, "conversations")
    assert {"id", "conversation_id", "role", "content", "status", "meta", "created_at"} <= _columns(db, "messages")


def test_m002_indexes_messages_written_before_it():
    db = _db()
    mig.m001_initial(db)
    db.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES ('c', 't', 0, 0)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES ('c', 'user', 'old zebra', 0)")
    mig.m002_message_search(db)
    assert db.execute("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'zebra'").fetchall() == [(1,)]
    # the triggers keep it in step afterwards
    db.execute("UPDATE messages SET content = 'new giraffe' WHERE id = 1")
    assert db.execute("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'zebra'").fetchall() == []
    assert db.execute("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'giraffe'").fetchall() == [(1,)]
    db.execute("DELETE FROM messages")
    assert db.execute("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'giraffe'").fetchall() == []


def test_m003_adds_branch_origin_to_existing_rows():
    db = _db()
    mig.m001_initial(db)
    db.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES ('c', 't', 0, 0)")
    mig.m003_branch_origin(db)
    row = db.execute("SELECT parent_id, parent_message_id FROM conversations").fetchone()
    assert tuple(row) == (None, None)


def test_m004_keeps_thoughts_apart_from_answers_written_before_it(store):
    db = _db()
    for step in (mig.m001_initial, mig.m002_message_search, mig.m003_branch_origin):
        step(db)
    db.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES ('c', 't', 0, 0)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES ('c', 'assistant', 'old', 0)")
    mig.m004_message_reasoning(db)
    assert db.execute("SELECT content, reasoning FROM messages").fetchall() == [("old", "")]
    # thoughts are not searched: the index stays on the answer's text
    db.execute("UPDATE messages SET reasoning = 'pondering zebras' WHERE id = 1")
    assert db.execute("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'zebras'").fetchall() == []
    # the store reads and writes them, and a branch, an export and an import carry them
    conv = store.create_conversation()
    user = store.add_message(conv.id, "user", "hi")
    answer = store.add_message(conv.id, "assistant", "")
    store.update_message(answer.id, content="Hello.", reasoning="The user greets me.")
    assert (store.get_message(answer.id).content, store.get_message(answer.id).reasoning) == ("Hello.", "The user greets me.")
    assert store.get_message(user.id).reasoning == ""
    branch = store.branch(conv.id, answer.id)
    assert [m.reasoning for m in store.messages(branch.id)] == ["", "The user greets me."]
    data = store.export_conversation(conv.id)
    assert [m.get("reasoning") for m in data["messages"]] == [None, "The user greets me."]
    store.delete_conversation(conv.id)
    assert store.messages(store.import_conversation(data).id)[1].reasoning == "The user greets me."
    assert model_messages(store, conv.id) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]


def test_m005_keeps_tool_calls_with_their_answer(store):
    db = _db()
    for step in MIGRATIONS[:4]:
        step(db)
    db.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES ('c', 't', 0, 0)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES ('c', 'assistant', 'old', 0)")
    mig.m005_message_tool_calls(db)
    assert db.execute("SELECT content, tool_calls FROM messages").fetchall() == [("old", "[]")]
    conv = store.create_conversation()
    store.add_message(conv.id, "user", "What is 2 + 3?")
    called = store.add_message(conv.id, "assistant", "")
    calls = [{"id": "call_1", "server": "calc", "name": "add", "arguments": '{"a": 2, "b": 3}', "outcome": "ok", "result": "5"},
             {"id": "call_2", "server": "calc", "name": "add", "arguments": '{"a": 1, "b": 1}', "outcome": "denied",
              "result": "The user refused this call."}]
    store.update_message(called.id, tool_calls=calls)
    store.add_message(conv.id, "assistant", "It is 5.")
    # the model is given each call and what came back, in order
    assert model_messages(store, conv.id) == [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [{k: c[k] for k in ("id", "name", "arguments")} for c in calls]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
        {"role": "tool", "content": "The user refused this call.", "tool_call_id": "call_2"},
        {"role": "assistant", "content": "It is 5."},
    ]
    branch = store.branch(conv.id, called.id)
    assert store.messages(branch.id)[1].tool_calls == calls
    data = store.export_conversation(conv.id)
    assert data["messages"][1]["tool_calls"] == calls and "tool_calls" not in data["messages"][0]
    store.delete_conversation(conv.id)
    assert store.messages(store.import_conversation(data).id)[1].tool_calls == calls


def test_failed_migration_rolls_back_and_is_not_recorded(monkeypatch):
    db = _db()

    def m999_broken(db):
        db.execute("CREATE TABLE half_done (x)")
        raise RuntimeError("boom")

    monkeypatch.setattr(mig, "MIGRATIONS", [*MIGRATIONS, m999_broken])
    with pytest.raises(RuntimeError):
        mig.migrate(db)
    assert "m999_broken" not in mig.applied(db)
    assert "half_done" not in {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
    assert mig.applied(db) == [m.__name__ for m in MIGRATIONS]


def test_open_store_creates_dirs_and_uses_wal(isolated_dirs):
    s = open_store(isolated_dirs)
    assert isolated_dirs.database.is_file()
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s.close()


def test_data_dir_and_database_are_private(isolated_dirs):
    """Conversations are nobody else's to read, whatever the umask: data and snapshots dirs 0700,
    the database and its WAL files 0600."""
    old = os.umask(0o022)
    try:
        s = open_store(isolated_dirs)
        s.create_conversation(title="secret")  # writes the WAL
        wal = isolated_dirs.database.with_name(isolated_dirs.database.name + "-wal")
        modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (isolated_dirs.data, isolated_dirs.snapshots, isolated_dirs.database, wal)}
        s.close()
    finally:
        os.umask(old)
    assert modes == {isolated_dirs.data: 0o700, isolated_dirs.snapshots: 0o700, isolated_dirs.database: 0o600, wal: 0o600}


def test_a_database_made_readable_by_others_is_made_private_again(isolated_dirs):
    open_store(isolated_dirs).close()
    isolated_dirs.database.chmod(0o644)
    open_store(isolated_dirs).close()
    assert stat.S_IMODE(isolated_dirs.database.stat().st_mode) == 0o600


def test_processes_migrating_a_new_database_at_once_all_succeed(tmp_path):
    """Two first runs at the same moment (the app and `edgechat run`): each migration is applied
    once, and the process that waited finds it done instead of failing on "table already exists"."""
    script = textwrap.dedent(
        """
        import os, sys, time
        from edgechat.store import Store
        from edgechat.store import migrations as mig

        applied = mig.applied

        def slow_applied(db):
            # every process reads "nothing applied yet" before any of them starts migrating
            names = applied(db)
            time.sleep(0.5)
            return names

        mig.applied = slow_applied
        # start together: say ready, wait for the go
        open(sys.argv[2] + "." + sys.argv[3], "w").close()
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.001)
        Store.connect(sys.argv[1]).close()
        """
    )
    db, go = tmp_path / "race.sqlite3", tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(db), str(go), str(i)], stderr=subprocess.PIPE, text=True)
        for i in range(3)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("go.*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    check = sqlite3.connect(db)
    assert [r[0] for r in check.execute("SELECT name FROM _migrations ORDER BY rowid")] == [m.__name__ for m in MIGRATIONS]
    check.close()


def test_open_store_on_garbage_is_a_store_error(isolated_dirs):
    isolated_dirs.data.mkdir(parents=True)
    isolated_dirs.database.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="cannot open"):
        open_store(isolated_dirs)


# -- conversations and messages ----------------------------------------------


def test_create_get_list_update_delete(store):
    a = store.create_conversation(model="smollm2-135m-instruct", settings={"temperature": 0.2})
    b = store.create_conversation(title="Second")
    assert a.title == DEFAULT_TITLE and a.settings == {"temperature": 0.2}
    assert store.get_conversation(a.id) == a
    assert [c.id for c in store.list_conversations()] == [b.id, a.id]
    store.update_conversation(a.id, title="Renamed", settings={"seed": 1})
    got = store.get_conversation(a.id)
    assert (got.title, got.settings, got.model) == ("Renamed", {"seed": 1}, "smollm2-135m-instruct")
    assert [c.id for c in store.list_conversations()] == [a.id, b.id]  # updated moves it to the top
    store.add_message(a.id, "user", "hi")
    store.delete_conversation(a.id)
    assert store.get_conversation(a.id) is None
    assert store.messages(a.id) == []
    with pytest.raises(StoreError):
        store.update_conversation(a.id, title="x")


def test_model_messages_keep_stopped_answers_and_drop_failed_or_empty_ones(store):
    conv = store.create_conversation(settings={"system_prompt": "Be brief."})
    store.add_message(conv.id, "user", "first")
    store.add_message(conv.id, "assistant", "half an ans", status="interrupted")
    store.add_message(conv.id, "user", "second")
    store.add_message(conv.id, "assistant", "boom", status="error")
    store.add_message(conv.id, "assistant", "")
    history = model_messages(store, conv.id)
    assert history == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "half an ans"},
        {"role": "user", "content": "second"},
    ]
    assert with_system_prompt(conv.settings, history)[0] == {"role": "system", "content": "Be brief."}
    assert with_system_prompt({"system_prompt": ""}, history) == history


def test_conversation_by_name(store):
    assert store.conversation_by_name("work", create=False) is None
    c = store.conversation_by_name("work")
    assert c.name == "work" and c.title == "work"
    assert store.conversation_by_name("work").id == c.id
    with pytest.raises(StoreError, match="already exists"):
        store.create_conversation(name="work")


def test_messages_and_auto_title(store):
    c = store.create_conversation()
    u = store.add_message(c.id, "user", "\n  What is the capital of France?\nthanks")
    a = store.add_message(c.id, "assistant", "", meta={"model": "m"})
    store.add_message(c.id, "user", "another question")
    assert store.get_conversation(c.id).title == "What is the capital of France?"
    store.update_message(a.id, content="Paris.", status="interrupted", meta={"ttft": 0.1})
    msgs = store.messages(c.id)
    assert [m.role for m in msgs] == ["user", "assistant", "user"]
    assert msgs[0].id == u.id
    assert (msgs[1].content, msgs[1].status, msgs[1].meta) == ("Paris.", "interrupted", {"model": "m", "ttft": 0.1})
    assert [m.content for m in store.messages(c.id, limit=2)] == ["Paris.", "another question"]
    assert store.count_messages(c.id) == 3
    assert [m.content for m in store.messages(c.id, limit=1, before=msgs[2].id)] == ["Paris."]
    assert store.count_messages(c.id, before=msgs[2].id) == 2
    with pytest.raises(ValueError):
        store.add_message(c.id, "assistant", "x", status="bogus")
    with pytest.raises(StoreError):
        store.add_message("nope", "user", "x")


def test_renamed_conversation_keeps_its_title(store):
    c = store.create_conversation(title="Mine")
    store.add_message(c.id, "user", "something else")
    assert store.get_conversation(c.id).title == "Mine"


def test_title_from_long_text():
    t = title_from("word " * 40)
    assert len(t) <= 61 and t.endswith("…")
    assert title_from("   \n ") == DEFAULT_TITLE


def test_delete_messages_from(store):
    c = store.create_conversation()
    ids = [store.add_message(c.id, r, str(i)).id for i, r in enumerate(["user", "assistant", "user", "assistant"])]
    assert store.delete_messages_from(c.id, ids[2]) == 2
    assert [m.content for m in store.messages(c.id)] == ["0", "1"]


# -- search, branch, export -------------------------------------------------------


def test_search_finds_words_across_conversations(store):
    a = store.create_conversation()
    b = store.create_conversation()
    store.add_message(a.id, "user", "Tell me about the Eiffel tower in Paris")
    store.add_message(b.id, "assistant", "Paris is the capital of France")
    store.add_message(b.id, "user", "unrelated")
    hits = store.search("paris")
    assert {h.conversation.id for h in hits} == {a.id, b.id}
    assert all("[Paris]" in h.snippet for h in hits)
    assert [h.conversation.id for h in store.search("eiff")] == [a.id]  # prefix match
    assert store.search("capital france")[0].message.role == "assistant"
    # the user's text is never query syntax
    assert store.search('paris" OR -x:') == []
    assert store.search("   ") == []


def test_branch_copies_up_to_message(store):
    c = store.create_conversation(title="Trip", settings={"system_prompt": "be brief"})
    msgs = [store.add_message(c.id, r, f"m{i}") for i, r in enumerate(["user", "assistant", "user", "assistant"])]
    br = store.branch(c.id, msgs[1].id)
    assert br.id != c.id and br.title == "Trip (branch)" and br.settings == {"system_prompt": "be brief"}
    assert (br.parent_id, br.parent_message_id) == (c.id, msgs[1].id)
    assert [m.content for m in store.messages(br.id)] == ["m0", "m1"]
    assert len(store.messages(c.id)) == 4
    other = store.create_conversation()
    with pytest.raises(StoreError):
        store.branch(other.id, msgs[0].id)


def test_export_import_round_trip_restores_a_deleted_conversation(store):
    c = store.create_conversation(settings={"seed": 3})
    store.add_message(c.id, "user", "hello")
    store.add_message(c.id, "assistant", "hi there", status="interrupted", meta={"tok_s": 90.0})
    data = store.export_conversation(c.id)
    store.delete_conversation(c.id)
    back = store.import_conversation(data)
    assert back.id == c.id and back.settings == {"seed": 3}
    assert store.export_conversation(c.id) == data
    assert store.search("hello")[0].conversation.id == c.id


def test_export_files(store, tmp_path):
    c = store.create_conversation(model="smollm2", settings={"system_prompt": "You are terse."})
    store.add_message(c.id, "user", "Say hi")
    store.add_message(c.id, "assistant", "Hi", status="interrupted")
    md = export_conversation(store, c.id, tmp_path / "out" / "chat.md")
    text = md.read_text()
    assert text.startswith("# Say hi\n")
    assert "## You\n\nSay hi" in text and "## Assistant (interrupted)\n\nHi" in text
    assert "You are terse." in text
    js = export_conversation(store, c.id, tmp_path / "chat.json")
    data = json.loads(js.read_text())
    assert [m["content"] for m in data["messages"]] == ["Say hi", "Hi"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["chat.md"]  # no temp files left


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    from edgechat.fsutil import atomic_write

    target = tmp_path / "f.txt"
    atomic_write_text(target, "old")

    def failing_midway():
        yield b"new data, half of it"
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(target, failing_midway())
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_writes_survive_a_killed_process(isolated_dirs):
    """Every write is committed when the call returns: SIGKILL right after loses nothing."""
    script = textwrap.dedent(
        """
        import os, signal, sys
        from edgechat.config import get_paths
        from edgechat.store import open_store
        s = open_store(get_paths(sys.argv[1]))
        c = s.conversation_by_name("k")
        s.add_message(c.id, "user", "question")
        m = s.add_message(c.id, "assistant", "part")
        s.update_message(m.id, content="partial answer", status="interrupted")
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script, str(isolated_dirs.data)], env=os.environ)
    assert proc.returncode == -signal.SIGKILL
    s = open_store(isolated_dirs)
    c = s.conversation_by_name("k", create=False)
    assert [(m.content, m.status) for m in s.messages(c.id)] == [
        ("question", "complete"),
        ("partial answer", "interrupted"),
    ]
    s.close()


def test_a_question_without_an_answer_is_left_out_of_the_prompt(store):
    """store/history.py's rule: a killed turn (its answer stored empty) or a failed one takes
    its question out of later prompts; the question being asked now (the last) stays."""
    conv = store.create_conversation()
    store.add_turn(conv.id, "killed before answering")
    store.add_message(conv.id, "user", "orphan of an older version")
    store.add_message(conv.id, "user", "failed")
    store.add_message(conv.id, "assistant", "boom", status="error")
    user, answer = store.add_turn(conv.id, "answered in part")
    store.update_message(answer.id, content="half")
    store.add_message(conv.id, "user", "now")
    assert model_messages(store, conv.id) == [
        {"role": "user", "content": "answered in part"},
        {"role": "assistant", "content": "half"},
        {"role": "user", "content": "now"},
    ]


def test_add_turn_stores_a_question_with_an_empty_interrupted_answer(store):
    conv = store.create_conversation()
    user, answer = store.add_turn(conv.id, "hi", meta={"model": "m"})
    assert [(m.role, m.status, m.content, m.meta) for m in store.messages(conv.id)] == [
        ("user", "complete", "hi", {}), ("assistant", "interrupted", "", {"model": "m"})]
    assert (user.id, answer.id) == tuple(m.id for m in store.messages(conv.id))


@pytest.fixture
def capped(isolated_dirs):
    """A store on disk that cannot grow past its current pages: SQLite answers SQLITE_FULL
    ("database or disk is full") as it does on a full disk."""
    s = open_store(isolated_dirs)
    conv = s.create_conversation()
    s.add_message(conv.id, "user", "before")

    def cap(on: bool):
        pages = s.db.execute("PRAGMA page_count").fetchone()[0]
        s.db.execute(f"PRAGMA max_page_count = {pages if on else 2**30}")

    yield s, conv, cap
    s.close()


def test_a_write_that_finds_no_room_is_one_line_and_rolled_back(capped):
    s, conv, cap = capped
    cap(True)
    with pytest.raises(StoreError, match="^cannot write the conversation store .*: database or disk is full$"):
        s.add_turn(conv.id, "x" * 100_000)
    # both or neither: the question is not left without its answer
    assert [m.content for m in s.messages(conv.id)] == ["before"]
    assert not s.db.in_transaction
    cap(False)
    s.add_turn(conv.id, "x" * 100_000)
    assert s.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_full_disk_names_the_disk_and_the_room_needed(tmp_path):
    s = Store.connect(tmp_path / "db.sqlite3")
    try:
        for message in ("database or disk is full", "disk I/O error"):
            error = s.write_error(sqlite3.OperationalError(message), size=1 << 50)
            assert re.fullmatch(rf"the disk holding {tmp_path} is full \(\d+ KB free, about \d+ KB needed\);"
                                " free some space and retry", str(error)), error
        assert s.write_error(sqlite3.OperationalError("no such table: x")) is None
    finally:
        s.close()


def test_an_answer_that_cannot_be_saved_keeps_its_text_and_says_so_once(capped):
    from edgechat.engine.types.request import Finished, RequestMetrics
    from edgechat.store.answer import StoredAnswer

    s, conv, cap = capped
    errors = []
    turn = StoredAnswer.ask(s, conv.id, "tell me", "m", on_error=errors.append)
    cap(True)
    turn.append("y" * 100_000)
    turn.append("z")
    assert turn.text == "y" * 100_000 + "z" and len(errors) == 1 and "database or disk is full" in errors[0]
    shown = turn.finish(Finished("stop", turn.text, RequestMetrics()))
    assert (shown.content, shown.status) == (turn.text, "complete") and len(errors) == 1
    assert s.get_message(turn.id).status == "interrupted"  # the store still marks it
    cap(False)
    assert turn.finish(Finished("stop", turn.text, RequestMetrics())).content == turn.text and turn.error is None
