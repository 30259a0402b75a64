"""KV snapshots on disk: one file per conversation, written atomically and tagged with what the
cells depend on (model hash, context size, KV type, llama.cpp state version). Any mismatch,
truncation or corruption means "rebuild by prefill". `PromptStore`: the prompt cache's states
(engine/kv/promptcache.py) the same way, one file per token prefix, so they outlive the process."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from edgechat.fsutil import atomic_write
from edgechat.models.ggufinfo import split_part_names

SNAPSHOT_MAGIC = b"ECKVSNP1"
PROMPT_MAGIC = b"ECPROMP1"

log = logging.getLogger("edgechat.engine")


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

    def __init__(self, root: Path, tags: dict | Callable[[], dict], budget_bytes: int):
        self.root = root
        # model hash, context size, KV type, llama.cpp state version; or what computes them on
        # first use (an engine's hashes the model, which a chat that never snapshots never waits for)
        self._tags = tags
        self.budget = budget_bytes

    @cached_property
    def tags(self) -> dict:
        return self._tags() if callable(self._tags) else self._tags

    def path_for(self, session: str) -> Path:
        return snapshot_path(self.root, session)

    def save(self, session: str, tokens: list[int], session_state: dict, data: bytes | bytearray) -> Path:
        header = json.dumps({"session": session, "tags": self.tags, "tokens": tokens, "state": session_state, "saved": time.time()}).encode()
        path = self.path_for(session)
        atomic_write(path, [SNAPSHOT_MAGIC, struct.pack("<Q", len(header)), header, data])
        self.enforce_budget(keep=path)
        return path

    def _read(self, session: str, with_data: bool) -> Snapshot | None:
        """The session's snapshot if its file is whole and its tags match; None for anything else."""
        tags = self.tags  # computed here first, on the caller's thread (prompt building), not the engine's
        try:
            with open(self.path_for(session), "rb") as fh:
                if fh.read(8) != SNAPSHOT_MAGIC:
                    return None
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
                data = fh.read() if with_data else b""
            if header.get("session") != session or header.get("tags") != tags:
                return None
            if with_data and not data:
                return None
            tokens = [int(t) for t in header["tokens"]]
            state = dict(header.get("state") or {})
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return None  # missing, truncated or corrupt: the caller rebuilds by prefill
        return Snapshot(tokens, state, data)

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

    def enforce_budget(self, keep: Path | None = None) -> list[Path]:
        """Remove the least recently used files (by mtime) until the rest fit; the removed ones."""
        files = sorted(self.root.glob("*.kv"), key=_mtime)
        sizes = {p: _size(p) for p in files}
        total = sum(sizes.values())
        removed = []
        for p in files:
            if total <= self.budget:
                break
            if p == keep:
                continue
            total -= sizes[p]
            p.unlink(missing_ok=True)
            removed.append(p)
        return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def prompt_key(tokens: list[int], tags: dict) -> str:
    """A token prefix's name under these tags: its file's, and the prompt cache's key for it (the
    same prompt on another context size is another file, never overwritten by this one)."""
    digest = hashlib.sha256(json.dumps(tags, sort_keys=True).encode())
    digest.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return digest.hexdigest()[:24]


@dataclass
class StoredPrompt:
    """A prompt state on disk, as its header describes it (the data stays unread)."""

    key: str
    tokens: list[int]
    path: Path
    nbytes: int


@dataclass
class PromptState:
    tokens: list[int]
    data: bytearray
    logits_n: int  # the logits after this many tokens (0: none kept)
    logits: bytes  # float32 values


class PromptStore(SnapshotStore):
    """The prompt cache's states on disk: a private folder (0700) of files named by their tokens'
    hash, each with its tags, tokens, the sequence state and the logits kept after the prompt,
    and a checksum; LRU by mtime within `budget` bytes. Files with other tags (another model,
    context or llama.cpp) are left alone and count against the budget; a truncated or corrupt
    one is removed with one log line."""

    def __init__(self, root: Path, tags: dict, budget_bytes: int):
        super().__init__(root, tags, budget_bytes)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)  # our folder alone: a mode widened by hand is narrowed again

    def path_for(self, session: str) -> Path:
        return self.root / f"{session}.kv"

    def save_state(self, state: PromptState) -> list[Path]:
        """Write one state (atomic); the files the budget removed to make room."""
        key = prompt_key(state.tokens, self.tags)
        header = json.dumps({
            "tags": self.tags, "tokens": state.tokens, "data_bytes": len(state.data), "logits_n": state.logits_n,
            "logits_bytes": len(state.logits), "crc32": zlib.crc32(state.logits, zlib.crc32(state.data)), "saved": time.time(),
        }).encode()
        path = self.path_for(key)
        atomic_write(path, [PROMPT_MAGIC, struct.pack("<Q", len(header)), header, state.data, state.logits])
        return self.enforce_budget(keep=path)

    def scan(self) -> list[StoredPrompt]:
        """The states made for these tags, least recently used first (headers only)."""
        found = []
        for path in sorted(self.root.glob("*.kv"), key=_mtime):
            try:
                header, _ = self._header(path)
            except _Unreadable as exc:
                self._discard(path, exc)
                continue
            except OSError:
                continue  # gone meanwhile (another server on this folder)
            if header.get("tags") == self.tags:
                found.append(StoredPrompt(path.stem, header["tokens"], path, _size(path)))
        return found

    def read_state(self, stored: StoredPrompt) -> PromptState | None:
        """The whole state, checked; None (and the file removed, in one log line) if it is not."""
        try:
            header, offset = self._header(stored.path)
            with open(stored.path, "rb") as fh:
                fh.seek(offset)
                data = bytearray(fh.read(header["data_bytes"]))
                logits = fh.read(header["logits_bytes"])
                rest = fh.read(1)
            if len(data) != header["data_bytes"] or len(logits) != header["logits_bytes"] or rest:
                raise _Unreadable(f"{len(data) + len(logits)} bytes of data where its header says {header['data_bytes'] + header['logits_bytes']}")
            if zlib.crc32(logits, zlib.crc32(data)) != header["crc32"]:
                raise _Unreadable("its checksum does not match")
        except _Unreadable as exc:
            self._discard(stored.path, exc)
            return None
        except OSError:
            return None
        return PromptState(stored.tokens, data, int(header["logits_n"]), logits)

    def touch(self, key: str) -> None:
        try:
            os.utime(self.path_for(key))  # LRU: a restored state is recently used
        except OSError:
            pass  # not written yet, or removed: nothing to order

    def _header(self, path: Path) -> tuple[dict, int]:
        """A prompt file's header and where its data starts; `_Unreadable` names what is wrong."""
        with open(path, "rb") as fh:
            head = fh.read(16)
            if len(head) < 16 or head[:8] != PROMPT_MAGIC:
                raise _Unreadable("it is not a prompt state file" if len(head) == 16 else "it is cut short")
            (n,) = struct.unpack("<Q", head[8:])
            if n > os.fstat(fh.fileno()).st_size - 16:  # a length read from garbage: never allocate it
                raise _Unreadable("its header is cut short or corrupt")
            raw = fh.read(n)
        try:
            header = json.loads(raw)
            for field in ("data_bytes", "logits_n", "logits_bytes", "crc32"):
                int(header[field])
            header["tokens"] = [int(t) for t in header["tokens"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise _Unreadable("its header is cut short or corrupt") from exc
        return header, 16 + n

    def _discard(self, path: Path, why: _Unreadable) -> None:
        log.warning("skipped the prompt cache file %s: %s; it is removed", path, why)
        path.unlink(missing_ok=True)


class _Unreadable(Exception):
    """A prompt file that is not whole (truncated) or not what it says (corrupt)."""

