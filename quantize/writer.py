"""Streaming GGUF output: metadata and tensor infos up front, then each tensor's bytes as produced.

gguf's GGUFWriter writes the header, key/values and tensor infos; tensor data is appended here
block by block so no tensor has to exist whole in memory. The file is written under a temporary
name next to the destination and renamed only when complete.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gguf import GGUFWriter, GGMLQuantizationType

from quantize.errors import QuantizeError
from quantize.ggml import row_size

ALIGNMENT = 32  # GGUF's default data alignment


def padded(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def tensor_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * row_size(qtype, shape[-1])


class StreamingGGUF:
    """Use as a context manager: on any exception (Ctrl+C included) the partial file is removed."""

    def __init__(self, out: Path, arch: str):
        self.out = out
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        self.writer = GGUFWriter(self.tmp, arch)
        self._fh = None
        self._pending: list[tuple[str, int]] = []

    def __enter__(self) -> "StreamingGGUF":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.writer.close()
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)

    def add_tensor_info(self, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> None:
        import numpy as np

        nbytes = tensor_nbytes(qtype, shape)
        self.writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        self._pending.append((name, nbytes))

    def begin_data(self) -> None:
        w = self.writer
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self._fh = w.fout[0]
        w.write_padding(self._fh, self._fh.tell())

    def write_tensor(self, name: str, chunks) -> None:
        """Append one tensor from an iterable of byte-like chunks, checking its size against its info."""
        expected_name, nbytes = self._pending.pop(0)
        if name != expected_name:
            raise RuntimeError(f"tensor {name} written out of order (expected {expected_name})")
        written = 0
        try:
            for chunk in chunks:
                self._fh.write(chunk)
                written += memoryview(chunk).nbytes
        except OSError as exc:
            raise QuantizeError(f"cannot write {self.out}: {exc.strerror}") from None
        if written != nbytes:
            raise RuntimeError(f"tensor {name}: wrote {written} bytes, expected {nbytes}")
        self._fh.write(b"\0" * (padded(nbytes) - nbytes))

    def commit(self) -> None:
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} tensors were never written")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.writer.close()
        os.replace(self.tmp, self.out)
