"""Streaming GGUF output: metadata and tensor infos up front, then each tensor's bytes as produced.

gguf's GGUFWriter writes the header, key/values and tensor infos; tensor data is appended here
block by block so no tensor has to exist whole in memory. The file is written under a temporary
name next to the destination and renamed only when complete.
"""

from __future__ import annotations

import os
import struct
import tempfile
from io import BufferedWriter
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState

from quantize.errors import QuantizeError
from quantize.ggml import row_size

ALIGNMENT = 32  # GGUF's default data alignment


_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


def _string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _value(value, vtype: GGUFValueType, sub_type: GGUFValueType | None) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _string(value)
    if vtype != GGUFValueType.ARRAY:
        return struct.pack(_SCALAR[vtype], value)
    if sub_type is None:  # GGUFWriter.add_array leaves it to be inferred from the elements
        sub_type = GGUFValueType.get_type(value[0]) if len(value) else GGUFValueType.UINT8
    head = struct.pack("<IQ", int(sub_type), len(value))
    if sub_type == GGUFValueType.STRING:
        return head + b"".join([_string(s) for s in value])
    return head + np.asarray(value, dtype=_NUMPY[sub_type]).tobytes()


class _Writer(GGUFWriter):
    """GGUFWriter with a vectorised key/value section: its per-element packing takes seconds on
    a 262k-token vocabulary (three arrays of that length)."""

    @property
    def output(self) -> BufferedWriter:
        """The one output file (never split here), open from write_header_to_file on."""
        assert self.fout is not None, "the header is not written yet"
        return self.fout[0]

    def write_kv_data_to_file(self) -> None:
        if self.state is not WriterState.HEADER:
            raise ValueError(f"Expected output file to contain the header, got {self.state}")
        parts = []
        for key, val in self.kv_data[0].items():
            parts.append(_string(key))
            parts.append(struct.pack("<I", int(val.type)))
            parts.append(_value(val.value, val.type, val.sub_type))
        self.output.write(b"".join(parts))
        self.flush()
        self.state = WriterState.KV_DATA


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
        self.writer = _Writer(self.tmp, arch)
        self._pending: list[tuple[str, int]] = []

    def __enter__(self) -> StreamingGGUF:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.writer.close()
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)

    def add_tensor_info(self, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> None:
        nbytes = tensor_nbytes(qtype, shape)
        self.writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        self._pending.append((name, nbytes))

    def begin_data(self) -> None:
        w = self.writer
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.write_padding(w.output, w.output.tell())
        except OSError as exc:
            raise QuantizeError(f"cannot write {self.out}: {exc.strerror}") from None

    def write_tensor(self, name: str, chunks) -> None:
        """Append one tensor from an iterable of byte-like chunks, checking its size against its info."""
        expected_name, nbytes = self._pending.pop(0)
        if name != expected_name:
            raise RuntimeError(f"tensor {name} written out of order (expected {expected_name})")
        fh = self.writer.output
        written = 0
        try:
            for chunk in chunks:
                fh.write(chunk)
                written += memoryview(chunk).nbytes
        except OSError as exc:
            raise QuantizeError(f"cannot write {self.out}: {exc.strerror}") from None
        if written != nbytes:
            raise RuntimeError(f"tensor {name}: wrote {written} bytes, expected {nbytes}")
        fh.write(b"\0" * (padded(nbytes) - nbytes))

    def commit(self) -> None:
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} tensors were never written")
        try:
            self.writer.output.flush()
            os.fsync(self.writer.output.fileno())
            self.writer.close()
            os.replace(self.tmp, self.out)
        except OSError as exc:
            raise QuantizeError(f"cannot write {self.out}: {exc.strerror}") from None
