"""Importance matrices against llama.cpp's own tools, on the two real test checkpoints.

llama-imatrix and llama-quantize are built from the vendored llama.cpp sources by
bench/build_llama_bench.sh (once per machine, cached, before the first test: conftest's
`llama_tools`). Our imatrix from the built-in calibration text must match llama-imatrix's on the
same text and context size, and a file we write must make llama-quantize --imatrix produce the
very bytes our quantizer writes with it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgechat.models.planner import default_threads
from quantize import convert
from quantize.calibrate import builtin_text, compute
from quantize.imatrix import read, write
from quantize.llm import use_extra_buffers
from tests.hf_fixtures import hf_checkpoint
from tests.test_quantize import _tensors

pytestmark = pytest.mark.slow

MODELS = ["smollm2-135m-instruct", "gemma3-270m"]
ROOT = Path(__file__).resolve().parents[1]
N_CTX, CHUNKS = 512, 2  # llama-imatrix's default context; two chunks keep the Python callback quick


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """model -> F16 GGUF, our imatrix file and llama-imatrix's file, each made once."""
    root = tmp_path_factory.mktemp("imatrix")
    cache: dict = {}

    def get(model: str, what: str) -> Path:
        if (model, what) not in cache:
            f16 = root / f"{model}-F16.gguf"
            if what == "f16":
                path = convert(hf_checkpoint(model), f16, type_name="F16").path
            elif what == "ours":
                path = write(compute(get(model, "f16"), builtin_text(), max_chunks=CHUNKS, threads=default_threads()),
                             root / f"{model}-ours.imatrix.gguf")
            else:
                calibration = ROOT / "quantize" / "calibration.txt"
                path = root / f"{model}-llama.imatrix.gguf"
                # the weights laid out as ours are (no repacking where we use none, on AMX CPUs): the same
                # matmul kernels, or the sums differ by more than their summation order
                layout = [] if use_extra_buffers() else ["--no-repack"]
                subprocess.run([str(what), "-m", str(get(model, "f16")), "-f", str(calibration), "-o", str(path),
                                "-c", str(N_CTX), "-b", str(N_CTX), "--chunks", str(CHUNKS), "-t", str(default_threads()), "--no-ppl", *layout],
                               check=True, capture_output=True)
            cache[model, what] = path
        return cache[model, what]

    return get


@pytest.mark.parametrize("model", MODELS)
def test_our_imatrix_matches_llama_imatrix(model, work, llama_tools):
    ours, theirs = read(work(model, "ours")), read(work(model, llama_tools / "llama-imatrix"))
    assert sorted(ours.entries) == sorted(theirs.entries)
    assert len(ours.entries) >= 7 * 18  # every layer's q, k, v, output, gate, up, down
    assert (ours.chunk_count, ours.chunk_size) == (theirs.chunk_count, theirs.chunk_size) == (CHUNKS, N_CTX)
    for name, (sums, counts) in theirs.entries.items():
        np.testing.assert_array_equal(ours.entries[name][1], counts)
        # the same squares summed in another order, over slightly different attention tiling
        np.testing.assert_allclose(ours.entries[name][0], sums, rtol=2e-3, atol=1e-6 * sums.max(), err_msg=name)


@pytest.mark.parametrize("type_name", ["Q4_K_M", "Q3_K_M", "IQ4_XS"])
@pytest.mark.parametrize("model", MODELS)
def test_byte_identical_to_llama_quantize_with_imatrix(model, type_name, work, llama_tools, tmp_path):
    imatrix_file = work(model, "ours")  # written by us, read by llama-quantize
    reference = tmp_path / "llama.gguf"
    subprocess.run([str(llama_tools / "llama-quantize"), "--imatrix", str(imatrix_file), str(work(model, "f16")),
                    str(reference), type_name, "2"], check=True, capture_output=True)
    ours = convert(hf_checkpoint(model), tmp_path / "ours.gguf", type_name=type_name, threads=default_threads(),
                   imatrix=read(imatrix_file), imatrix_source=str(imatrix_file)).path
    mine, theirs = _tensors(ours), _tensors(reference)
    assert list(mine) == list(theirs)
    assert {n: t for n, (t, _) in mine.items()} == {n: t for n, (t, _) in theirs.items()}
    for name, (_, data) in mine.items():
        assert np.array_equal(data, theirs[name][1]), name
    if type_name == "Q4_K_M":  # and the importance data did change the quantized weights
        plain = _tensors(convert(hf_checkpoint(model), tmp_path / "plain.gguf", type_name=type_name, threads=default_threads()).path)
        assert sum(not np.array_equal(data, plain[name][1]) for name, (_, data) in mine.items()) > 50


def _quantize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgechat", "quantize", *args], check=False, capture_output=True, text=True,
                          timeout=600)


def test_low_bit_types_are_refused_without_an_imatrix(tmp_path):
    result = _quantize(str(hf_checkpoint("smollm2-135m-instruct")), "--type", "IQ2_XS", "-o", str(tmp_path / "m.gguf"))
    assert result.returncode == 1
    assert result.stderr.startswith("edgechat: error: IQ2_XS needs an importance matrix")
    assert len(result.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_corrupt_or_mismatched_imatrix_is_refused(work, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    good = work("gemma3-270m", "ours").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[: len(good) // 2])
    smollm = str(hf_checkpoint("smollm2-135m-instruct"))
    for imatrix, message in [(truncated, "is not a readable GGUF imatrix"),
                             (work("gemma3-270m", "ours"), "was made for another model")]:
        result = _quantize(smollm, "--imatrix", str(imatrix), "-o", str(out / "m.gguf"), "--no-report")
        assert result.returncode == 1, result.stderr
        assert message in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
        assert list(out.iterdir()) == []


def test_imatrix_file_round_trip(work, tmp_path):
    first = read(work("smollm2-135m-instruct", "ours"))
    again = read(write(first, tmp_path / "again.gguf"))
    assert (again.datasets, again.chunk_count, again.chunk_size) == (first.datasets, first.chunk_count, first.chunk_size)
    assert again.entries.keys() == first.entries.keys()
    for name, (sums, counts) in first.entries.items():
        assert np.array_equal(again.entries[name][0], sums) and np.array_equal(again.entries[name][1], counts)
