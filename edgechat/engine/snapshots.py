"""KV snapshots on disk: one file per conversation, written atomically and tagged with what the
cells depend on (model hash, context size, KV type, llama.cpp state version). Any mismatch,
truncation or corruption means "rebuild by prefill"."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from edgechat.fsutil import atomic_write
from edgechat.models.ggufinfo import split_part_names

SNAPSHOT_MAGIC = b"ECKVSNP1"
#: the "session" of a saved prompt state: no conversation id starts so
PROMPT_PREFIX = "\x00prompt:"


def model_fingerprint(path: Path, cache_dir: Path) -> str:
    """sha256 of the model's files (every part of a split model, every file of an ONNX
    folder), remembered per (path, size, mtime) so it is computed once."""
    if path.is_dir():
        parts = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        parts = [path.parent / name for name in split_part_names(path.name)]
    stamp = "|".join(f"{p.resolve()}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in parts)
    key = hashlib.sha256(stamp.encode()).hexdigest()[:32]
    memo = cache_dir / "model-hashes" / key
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = hashlib.sha256()
    for part in parts:
        with open(part, "rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
    value = digest.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(memo, [value.encode()])
    except OSError:
        pass  # a full or read-only disk: the hash is computed again next time
    return value


@dataclass
class Snapshot:
    tokens: list[int]
    session_state: dict
    data: bytes


def snapshot_path(root: Path, session: str) -> Path:
    """One file per conversation; hashed so any conversation id is a safe file name."""
    return root / f"{hashlib.sha256(session.encode()).hexdigest()[:24]}.kv"


class SnapshotStore:
    """Sequence snapshots on disk, one file per session, tagged with what they depend on."""

    def __init__(self, root: Path, tags: dict, budget_bytes: int):
        self.root = root
        self.tags = tags  # model hash, context size, KV type, llama.cpp state version
        self.budget = budget_bytes

    def path_for(self, session: str) -> Path:
        return snapshot_path(self.root, session)

    def save(self, session: str, tokens: list[int], session_state: dict, data: bytes | bytearray) -> Path:
        header = json.dumps({"session": session, "tags": self.tags, "tokens": tokens, "state": session_state, "saved": time.time()}).encode()
        path = self.path_for(session)
        atomic_write(path, [SNAPSHOT_MAGIC, struct.pack("<Q", len(header)), header, data])
        self.enforce_budget(keep=path)
        return path

    def save_prompt(self, tokens: list[int], data: bytes | bytearray) -> Path:
        """A prompt cache entry's state (engine/promptcache.py), kept while its model is unloaded."""
        digest = hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()[:24]
        return self.save(PROMPT_PREFIX + digest, tokens, {}, data)

    def take_prompts(self) -> list[tuple[list[int], bytes]]:
        """Every valid saved prompt state (oldest first), removed from disk as it is read."""
        found = []
        for path in sorted(self.root.glob("*.kv"), key=_mtime):
            head = self._read_path(path, None, with_data=False)  # a conversation's cells stay unread
            if head is None or not head[0].startswith(PROMPT_PREFIX):
                continue
            if (snap := self._read_path(path, head[0], with_data=True)) is not None:
                found.append((snap[1].tokens, snap[1].data))
            path.unlink(missing_ok=True)
        return found

    def _read(self, session: str, with_data: bool) -> Snapshot | None:
        found = self._read_path(self.path_for(session), session, with_data)
        return found[1] if found else None

    def _read_path(self, path: Path, session: str | None, with_data: bool) -> tuple[str, Snapshot] | None:
        """(session, snapshot) of a file whose tags match (and whose session is `session`, if
        given); None for anything else."""
        try:
            with open(path, "rb") as fh:
                if fh.read(8) != SNAPSHOT_MAGIC:
                    return None
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
                data = fh.read() if with_data else b""
            name = header.get("session")
            if not isinstance(name, str) or session is not None and name != session or header.get("tags") != self.tags:
                return None
            if with_data and not data:
                return None
            tokens = [int(t) for t in header["tokens"]]
            state = dict(header.get("state") or {})
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return None  # missing, truncated or corrupt: the caller rebuilds by prefill
        return name, Snapshot(tokens, state, data)

    def load(self, session: str) -> Snapshot | None:
        """The snapshot if it exists, is whole, and every tag matches; otherwise None (rebuild)."""
        snap = self._read(session, with_data=True)
        if snap is not None:
            try:
                os.utime(self.path_for(session))  # LRU: a restored snapshot is recently used
            except OSError:
                pass  # a read-only disk only loses the LRU order
        return snap

    def peek_state(self, session: str) -> dict | None:
        """The conversation's eviction state from a valid snapshot's header, without its data."""
        snap = self._read(session, with_data=False)
        return snap.session_state if snap else None

    def delete(self, session: str) -> None:
        self.path_for(session).unlink(missing_ok=True)

    def enforce_budget(self, keep: Path | None = None) -> None:
        files = sorted(self.root.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total <= self.budget:
                break
            if p == keep:
                continue
            total -= p.stat().st_size
            p.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0

