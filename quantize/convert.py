"""One pass from a safetensors checkpoint to a final GGUF: read rows, convert, quantize, write.

Memory stays bounded by a block of rows per worker (plus the tokenizer), whatever the model's
size: each tensor is read from the memory-mapped checkpoint block by block, rounded to the
intermediate float type (F16 by default, as llama.cpp's converter writes), quantized with
ggml's kernels and appended to the output.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from quantize.architecture import Family, PlannedTensor, family_for
from quantize.errors import QuantizeError
from quantize.ggml import quantize_rows
from quantize.imatrix import Imatrix, check_against
from quantize.mixture import (
    FILE_TYPES,
    FileType,
    Model,
    Overrides,
    TensorShape,
    choose_types,
    file_type,
    is_quantized,
    needs_imatrix,
)
from quantize.safetensors import Checkpoint
from quantize.source import read_config, resolve_source
from quantize.writer import StreamingGGUF, padded, tensor_nbytes

#: quality order for --target-size: the first type that fits wins
BY_QUALITY = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "Q4_0"]

# Rows per quantization job: llama.cpp's own chunking unit, and small enough to bound memory.
BLOCK_ROWS = 256

# Room left free on the disk beyond the output's size (file system metadata, other writers).
DISK_MARGIN = 64 * 1024 * 1024

_LAYER = re.compile(r"^blk\.(\d+)\.")

Progress = Callable[[str, int, int], None]


@dataclass
class Result:
    path: Path
    arch: str
    file_type: str
    nbytes: int
    n_tensors: int


def _stored_type(p: PlannedTensor, outtype: T) -> T:
    # llama.cpp's converter keeps 1D tensors, norms and biases in F32 whatever the output type
    if len(p.shape) <= 1 or p.name.endswith("_norm.weight") or not p.name.endswith(".weight"):
        return T.F32
    return outtype


def _order(planned: list[PlannedTensor]) -> list[PlannedTensor]:
    # llama.cpp's quantizer writes tensors sorted by layer, then name; do the same
    return sorted(planned, key=lambda p: (int(m.group(1)) if (m := _LAYER.match(p.name)) else -1, p.name))


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32)
    # round to nearest even; NaNs stay NaN (quiet bit set) instead of rounding to infinity
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def _round_through(x: np.ndarray, intermediate: T) -> np.ndarray:
    """Values as they would be after being stored as `intermediate` and read back as float32."""
    if intermediate == T.F16:
        return x.astype(np.float16).astype(np.float32)
    if intermediate == T.BF16:
        return (_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    return x


def _encode(x: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if qtype == T.F16:
        return x.astype(np.float16)
    if qtype == T.BF16:
        return _to_bf16_bits(np.ascontiguousarray(x, dtype=np.float32))
    raise AssertionError(qtype)


def _chunks(p: PlannedTensor, qtype: T, intermediate: T, pool: ThreadPoolExecutor, depth: int,
            weights: np.ndarray | None = None):
    """The tensor's bytes in row order, with up to `depth` blocks being worked on at once."""
    if len(p.shape) == 1:
        yield _encode(p.rows(0, 1).reshape(-1), qtype)
        return
    n_rows = int(np.prod(p.shape[:-1]))

    def job(start: int) -> np.ndarray:
        rows = p.rows(start, min(start + BLOCK_ROWS, n_rows))
        if is_quantized(qtype):
            return quantize_rows(qtype, _round_through(rows, intermediate), weights)
        return _encode(rows, qtype)

    pending: deque = deque()
    for start in range(0, n_rows, BLOCK_ROWS):
        pending.append(pool.submit(job, start))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def plan_types(family: Family, planned: list[PlannedTensor], ftype: FileType, outtype: T, *,
               has_imatrix: bool = False, overrides: Overrides | None = None) -> dict[str, T]:
    stored = ftype.default if not is_quantized(ftype.default) else outtype
    shapes = [TensorShape(p.name, p.shape, _stored_type(p, stored)) for p in planned]
    model = Model(family.n_layer, n_gqa=family.n_head // family.n_head_kv, is_70b=family.is_70b)
    return choose_types(shapes, ftype, model, has_imatrix=has_imatrix, overrides=overrides)


def check_imatrix_needs(types: dict[str, T], ftype: FileType, imatrix: Imatrix | None, source: str | None) -> None:
    """Refuse, before writing anything, a mixture whose very low-bit tensors would have no imatrix data."""
    for name, qtype in types.items():
        if not needs_imatrix(name, qtype, ftype):
            continue
        if imatrix is None:
            raise QuantizeError(
                f"{ftype.name} needs an importance matrix ({name} becomes {qtype.name}); pass --imatrix "
                "with a calibration text or an imatrix file"
            )
        if name not in imatrix.entries:
            raise QuantizeError(f"{source} has no data for {name}, which {ftype.name} makes {qtype.name}")


def output_size(planned: list[PlannedTensor], types: dict[str, T]) -> int:
    return sum(padded(tensor_nbytes(types[p.name], p.shape)) for p in planned)


def pick_type_for_size(family: Family, planned: list[PlannedTensor], outtype: T, limit: int) -> str:
    for name in BY_QUALITY:
        if output_size(planned, plan_types(family, planned, FILE_TYPES[name], outtype)) <= limit:
            return name
    smallest = output_size(planned, plan_types(family, planned, FILE_TYPES[BY_QUALITY[-1]], outtype))
    raise QuantizeError(f"no type fits {limit / 1e6:.0f} MB; the smallest ({BY_QUALITY[-1]}) needs {smallest / 1e6:.0f} MB")


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    type_name: str | None = "Q4_K_M",
    outtype: str = "F16",
    target_size: int | None = None,
    threads: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
    imatrix: Imatrix | None = None,
    imatrix_source: str = "the imatrix",
    overrides: Overrides | None = None,
) -> Result:
    """Convert the checkpoint `src` (folder or Hub repo id) to a GGUF of `type_name` at `out`."""
    folder, model_name = resolve_source(str(src))
    config = read_config(folder)
    family = family_for(folder, config)
    intermediate = file_type(outtype).default
    if is_quantized(intermediate):
        raise QuantizeError(f"--outtype must be f16, bf16 or f32, not {outtype}")
    vocab = family.vocab()
    threads = threads or os.cpu_count() or 1

    with Checkpoint(folder) as checkpoint:
        if not checkpoint.tensors:
            raise QuantizeError(f"the safetensors files in {folder} hold no tensors")
        planned = _order(family.plan(checkpoint))
        if target_size is not None:
            type_name = pick_type_for_size(family, planned, intermediate, target_size)
        try:
            ftype = file_type(type_name or "Q4_K_M")
        except KeyError:
            raise QuantizeError(f"unknown type {type_name}; choose from {', '.join(FILE_TYPES)}") from None
        types = plan_types(family, planned, ftype, intermediate, has_imatrix=imatrix is not None, overrides=overrides)
        if imatrix is not None:
            check_against(imatrix, {p.name: p.shape for p in planned}, imatrix_source)
        check_imatrix_needs(types, ftype, imatrix, imatrix_source)
        nbytes = output_size(planned, types)

        out_path = Path(out) if out else Path.cwd() / f"{model_name}-{ftype.name}.gguf"
        if out_path.exists() and not force:
            raise QuantizeError(f"{out_path} exists; pass --force to overwrite it")
        if not out_path.parent.is_dir():
            raise QuantizeError(f"output folder {out_path.parent} does not exist")
        free = shutil.disk_usage(out_path.parent).free
        if free < nbytes + DISK_MARGIN:
            raise QuantizeError(
                f"not enough disk space in {out_path.parent}: need {(nbytes + DISK_MARGIN) / 1e6:.0f} MB, "
                f"{free / 1e6:.0f} MB free"
            )

        with StreamingGGUF(out_path, family.arch_name) as gguf_out:
            w = gguf_out.writer
            w.add_type("model")
            w.add_name(model_name)
            family.write_hparams(w)
            w.add_file_type(int(ftype.ftype))
            if is_quantized(ftype.default):
                w.add_quantization_version(2)
            if imatrix is not None:
                # the keys llama-quantize records, so tools that read them see where the weights came from
                w.add_string("quantize.imatrix.file", imatrix_source)
                if imatrix.datasets:
                    w.add_string("quantize.imatrix.dataset", imatrix.datasets[0])
                w.add_uint32("quantize.imatrix.entries_count", len(imatrix.entries))
                if imatrix.chunk_count:
                    w.add_uint32("quantize.imatrix.chunks_count", imatrix.chunk_count)
            vocab.write(w)
            for p in planned:
                gguf_out.add_tensor_info(p.name, p.shape, types[p.name])
            gguf_out.begin_data()
            with ThreadPoolExecutor(max_workers=threads) as pool:
                for i, p in enumerate(planned):
                    if progress:
                        progress(p.name, i, len(planned))
                    weights = imatrix.weights(p.name) if imatrix is not None and is_quantized(types[p.name]) else None
                    gguf_out.write_tensor(p.name, _chunks(p, types[p.name], intermediate, pool, 2 * threads, weights))
            if progress:
                progress("done", len(planned), len(planned))
            gguf_out.commit()
    return Result(out_path, family.arch_name, ftype.name, out_path.stat().st_size, len(planned))
