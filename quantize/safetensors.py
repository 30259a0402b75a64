"""Reading safetensors checkpoints by memory-mapping them: a JSON header, then raw little-endian data.

Nothing here executes code from the checkpoint, unlike pickle-based formats.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantize.errors import QuantizeError

# numpy has no bfloat16; BF16 is read as raw uint16 and widened by bit shifting in `to_f32`.
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

# A header larger than this is not a real checkpoint header (the format's own limit is 100 MB).
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: its file's mapping and its place in it."""

    name: str
    dtype: str  # "F32", "F16" or "BF16"
    shape: tuple[int, ...]
    file: SafetensorsFile
    start: int  # byte offset of the data in the file
    nbytes: int

    def array(self) -> np.ndarray:
        """The raw data as a read-only numpy view of the mapping (no copy)."""
        count = int(np.prod(self.shape)) if self.shape else 1
        return np.frombuffer(self.file.buffer, dtype=_DTYPES[self.dtype], count=count, offset=self.start).reshape(self.shape)

    def rows_f32(self, rows) -> np.ndarray:
        """Rows (a slice or an index array over the first axis) as float32, reading only those rows."""
        data = self.array()
        if data.ndim == 0:
            data = data.reshape(1)
        return to_f32(data[rows], self.dtype)

    def release(self, first_row: int, stop_row: int) -> None:
        """Drop the mapped pages of rows already converted, so a pass over a large checkpoint does
        not keep it all resident (file pages count toward the process's memory)."""
        if not isinstance(self.file.buffer, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        row_bytes = self.nbytes // self.shape[0] if self.shape else self.nbytes
        begin = self.start + first_row * row_bytes
        end = self.start + stop_row * row_bytes
        begin = (begin + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages only
        if end > begin:
            self.file.buffer.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def to_f32(data: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 copy (never a view of the mapping, whose pages may be released afterwards)."""
    if dtype == "BF16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return np.array(data, dtype=np.float32)


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        try:
            self._fh = open(path, "rb")
            size = path.stat().st_size
            head = self._fh.read(8)
            if len(head) < 8:
                raise QuantizeError(f"{path.name} is not a safetensors file (too short); re-download it")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_MAX_HEADER, size - 8):
                raise QuantizeError(f"{path.name} has a corrupt safetensors header (length {header_len}); re-download it")
            header = json.loads(self._fh.read(header_len))
            if not isinstance(header, dict):
                raise ValueError("header is not an object")
        except (ValueError, UnicodeDecodeError) as exc:
            self.close()
            raise QuantizeError(f"{path.name} has a corrupt safetensors header ({exc}); re-download it") from None
        except OSError as exc:
            self.close()
            raise QuantizeError(f"cannot read {path}: {exc.strerror}") from None
        self.buffer = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        data_start = 8 + header_len
        self.tensors: dict[str, TensorRef] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise QuantizeError(f"{path.name} has a corrupt safetensors header (entry {name}); re-download it") from None
            if dtype not in _DTYPES:
                raise QuantizeError(
                    f"{path.name}: tensor {name} is {dtype}; only F32, F16 and BF16 checkpoints can be converted"
                )
            expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize if shape else np.dtype(_DTYPES[dtype]).itemsize
            if end - begin != expected or data_start + end > size or begin < 0:
                raise QuantizeError(
                    f"{path.name}: tensor {name} does not fit the file (truncated download?); re-download it"
                )
            self.tensors[name] = TensorRef(name, dtype, shape, self, data_start + begin, end - begin)

    def close(self) -> None:
        buf = getattr(self, "buffer", None)
        if isinstance(buf, mmap.mmap):
            try:
                buf.close()
            except BufferError:
                pass  # a numpy view still uses it; the mapping goes when that view does
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()


class Checkpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint, by name."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError):
                raise QuantizeError(f"{index.name} is not a valid safetensors index; re-download it") from None
            missing = [n for n in names if not (folder / n).is_file()]
            if missing:
                raise QuantizeError(f"checkpoint shard {missing[0]} is missing from {folder}; download all shards")
            files = [folder / n for n in names]
        else:
            files = sorted(folder.glob("*.safetensors"))
        self.files = []
        self.tensors: dict[str, TensorRef] = {}
        try:
            for path in files:
                shard = SafetensorsFile(path)
                self.files.append(shard)
                self.tensors.update(shard.tensors)
        except BaseException:
            self.close()
            raise

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
