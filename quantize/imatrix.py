"""Importance matrices in llama.cpp's GGUF imatrix format: read, write, and turn into per-column weights.

An importance matrix says, for each weight matrix, how large the activations entering each of
its input columns were on some calibration text: the sum of their squares (`<name>.in_sum2`,
one row per expert) and how many tokens were summed (`<name>.counts`). The quantizer weighs each
column's rounding error by sum / count, so columns that carry large activations are kept closer.
The layout and keys are llama-imatrix's, so files move between the two tools both ways.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantize.errors import QuantizeError

SUMS, COUNTS = ".in_sum2", ".counts"
KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"


@dataclass
class Imatrix:
    #: weight name -> (sums: float32 [n_mat, n_cols], counts: float32 [n_mat])
    entries: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def weights(self, name: str) -> np.ndarray | None:
        """The per-column weights llama-quantize derives for tensor `name`: sum / count per
        expert (1 where nothing was counted), flattened; None if the file has no entry."""
        if name not in self.entries:
            return None
        sums, counts = self.entries[name]
        # counts are token counts stored as floats; llama.cpp rounds them back to integers first
        n = np.rint(counts).astype(np.float32)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(n > 0, sums / np.where(n > 0, n, np.float32(1)), np.float32(1))
        return np.ascontiguousarray(w, dtype=np.float32).reshape(-1)


def is_imatrix_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a GGUF file (an imatrix), as opposed to calibration text."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def read(path: str | os.PathLike) -> Imatrix:
    from gguf import GGMLQuantizationType, GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise QuantizeError(f"{path} is not a readable GGUF imatrix ({exc})") from None
    result = Imatrix()
    field_ = reader.fields.get(KEY_DATASETS)
    if field_ is not None:
        result.datasets = [bytes(field_.parts[i]).decode("utf-8", "replace") for i in field_.data]
    for key, attr in ((KEY_CHUNK_COUNT, "chunk_count"), (KEY_CHUNK_SIZE, "chunk_size")):
        if (f := reader.fields.get(key)) is not None:
            setattr(result, attr, int(f.parts[f.data[0]][0]))
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.tensor_type != GGMLQuantizationType.F32:
            raise QuantizeError(f"{path}: imatrix tensor {t.name} is {t.tensor_type.name}, not F32")
        data = np.asarray(t.data, dtype=np.float32)
        if t.name.endswith(SUMS):
            sums[t.name[: -len(SUMS)]] = data.reshape(-1, int(t.shape[0]))
        elif t.name.endswith(COUNTS):
            counts[t.name[: -len(COUNTS)]] = data.reshape(-1)
    if not sums:
        raise QuantizeError(f"{path} holds no importance data (no *{SUMS} tensors); is it an imatrix file?")
    for name in sorted(sums.keys() | counts.keys()):
        if name not in sums or name not in counts:
            raise QuantizeError(f"{path}: {name} has sums without counts or counts without sums")
        if len(counts[name]) != sums[name].shape[0]:
            raise QuantizeError(f"{path}: {name} has {sums[name].shape[0]} rows of sums but {len(counts[name])} counts")
        if not np.isfinite(sums[name]).all():
            raise QuantizeError(f"{path}: {name} holds non-finite values")
        result.entries[name] = (sums[name], counts[name])
    return result


def write(imatrix: Imatrix, path: str | os.PathLike) -> Path:
    """Write `imatrix` as llama-imatrix does (sorted names, F32 sums and counts), atomically."""
    import tempfile

    from gguf import GGUFWriter

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        w = GGUFWriter(tmp, "imatrix")
        w.kv_data[0].clear()  # an imatrix names no architecture
        w.add_type("imatrix")
        w.add_array(KEY_DATASETS, imatrix.datasets)
        w.add_uint32(KEY_CHUNK_COUNT, imatrix.chunk_count)
        w.add_uint32(KEY_CHUNK_SIZE, imatrix.chunk_size)
        for name in sorted(imatrix.entries):
            sums, counts = imatrix.entries[name]
            w.add_tensor(name + SUMS, np.ascontiguousarray(sums, dtype=np.float32))
            w.add_tensor(name + COUNTS, np.ascontiguousarray(counts, dtype=np.float32).reshape(-1, 1))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except OSError as exc:
        raise QuantizeError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def check_against(imatrix: Imatrix, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Refuse an imatrix made for another model: names none of our weights, or sizes that differ."""
    known = [name for name in imatrix.entries if name in shapes]
    if not known:
        sample = next(iter(imatrix.entries))
        raise QuantizeError(f"{source} was made for another model: none of its tensors (e.g. {sample}) is in this one")
    for name in known:
        sums, _ = imatrix.entries[name]
        shape = shapes[name]
        n_mat = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
        if sums.shape != (n_mat, shape[-1]):
            raise QuantizeError(
                f"{source} was made for another model: {name} has {sums.shape[1]} columns there, {shape[-1]} here"
            )
