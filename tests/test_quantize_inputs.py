"""edgechat quantize refuses bad inputs with one clear line and leaves nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from quantize import QuantizeError, convert
from tests.hf_fixtures import hf_checkpoint

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2():
    return hf_checkpoint(SMOLLM2)


def _copy_folder(src: Path, dest: Path, skip: tuple[str, ...] = ()) -> Path:
    """A checkpoint folder whose files link to the fixture's, so each test can break one thing."""
    dest.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dest / f.name).symlink_to(f)
    return dest


def _edgechat(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgechat", *args], check=False, capture_output=True, text=True, timeout=300)


def test_missing_folder_is_one_line_error(tmp_path):
    result = _edgechat("quantize", str(tmp_path / "nope"), "-o", str(tmp_path / "out.gguf"))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"edgechat: error: {tmp_path / 'nope'} is neither a checkpoint folder nor a Hugging Face repo id (owner/name)"
    ]


def test_missing_config(smollm2, tmp_path):
    folder = _copy_folder(smollm2, tmp_path / "m", skip=("config.json",))
    with pytest.raises(QuantizeError, match="has no config.json"):
        convert(folder, tmp_path / "out.gguf")


def test_missing_tokenizer(smollm2, tmp_path):
    folder = _copy_folder(smollm2, tmp_path / "m", skip=("tokenizer.json",))
    with pytest.raises(QuantizeError, match="no tokenizer.json or tokenizer.model"):
        convert(folder, tmp_path / "out.gguf")


def test_unsupported_architecture_names_the_supported_ones(smollm2, tmp_path):
    folder = _copy_folder(smollm2, tmp_path / "m", skip=("config.json",))
    config = json.loads((smollm2 / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizeError) as err:
        convert(folder, tmp_path / "out.gguf")
    message = str(err.value)
    assert "GPT2LMHeadModel is not supported" in message
    for name in ("LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


def test_pickle_only_checkpoint_is_refused(smollm2, tmp_path):
    folder = _copy_folder(smollm2, tmp_path / "m", skip=("model.safetensors",))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(QuantizeError, match="only pickle weights .*safetensors only"):
        convert(folder, tmp_path / "out.gguf")


def _fake_safetensors(path: Path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize(
    "header,data,message",
    [
        (b"{not json", b"", "corrupt safetensors header"),
        (b"x" * 16, b"", "corrupt safetensors header"),
        (json.dumps({"model.embed_tokens.weight": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode(),
         b"\0" * 8, "does not fit the file"),
        (json.dumps({"model.embed_tokens.weight": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).encode(),
         b"\0" * 8, "only F32, F16 and BF16"),
    ],
)
def test_corrupt_safetensors(smollm2, tmp_path, header, data, message):
    folder = _copy_folder(smollm2, tmp_path / "m", skip=("model.safetensors",))
    _fake_safetensors(folder / "model.safetensors", header, data)
    with pytest.raises(QuantizeError, match=message):
        convert(folder, tmp_path / "out.gguf")


def test_huge_header_length_is_refused(smollm2, tmp_path):
    folder = _copy_folder(smollm2, tmp_path / "m", skip=("model.safetensors",))
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(QuantizeError, match="corrupt safetensors header"):
        convert(folder, tmp_path / "out.gguf")


def test_not_enough_disk(smollm2, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(QuantizeError, match="not enough disk space"):
        convert(smollm2, tmp_path / "out.gguf")
    assert list(tmp_path.iterdir()) == []


def test_unknown_type(smollm2, tmp_path):
    with pytest.raises(QuantizeError, match="unknown type Q3_X"):
        convert(smollm2, tmp_path / "out.gguf", type_name="Q3_X")


def test_existing_output_needs_force(smollm2, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    result = _edgechat("quantize", str(smollm2), "-o", str(out), "--type", "Q8_0", "--no-report")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"edgechat: error: {out} exists; pass --force to overwrite it"
    assert out.read_bytes() == b"keep me"
    result = _edgechat("quantize", str(smollm2), "-o", str(out), "--type", "Q8_0", "--no-report", "--force")
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:4] == b"GGUF"
    assert f"wrote {out} (llama Q8_0" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf"]


def test_interrupt_leaves_nothing_behind(smollm2, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def interrupt(name, done, total):
        if done == total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(smollm2, out_dir / "model.gguf", type_name="Q4_K_M", progress=interrupt)
    assert os.listdir(out_dir) == []


def test_gguf_source_needs_allow_requantize(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF")
    result = _edgechat("quantize", str(src))
    assert result.returncode == 2
    assert "requantizing loses quality" in result.stderr
    assert "--allow-requantize" in result.stderr


def test_report_needs_reference(tmp_path):
    result = _edgechat("quantize", "--report", str(tmp_path / "q.gguf"))
    assert result.returncode == 2
    assert result.stderr.strip() == "edgechat: error: --report needs --reference F16.gguf to compare with"


def test_conversion_imports_nothing_heavy_or_from_the_app(smollm2, tmp_path):
    """House rule: the quantizer runs without torch and without edgechat (a phone has neither to spare)."""
    code = (
        "import sys; from quantize import convert; "
        f"convert({str(smollm2)!r}, {str(tmp_path / 'out.gguf')!r}, type_name='Q8_0'); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'edgechat', 'llama_cpp'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert (tmp_path / "out.gguf").stat().st_size > 100_000_000


def test_report_warns_only_when_the_loss_is_large_for_the_type():
    from quantize.report import Quality

    typical = Quality(400, 14.0, 14.6, 0.07, 0.81)
    assert typical.warning("Q4_K_M") is None
    assert "Q8_0" in typical.warning("Q8_0")  # the same loss is too much for an 8-bit type
    assert abs(typical.ppl_ratio - 14.6 / 14.0) < 1e-12
    assert "top-1 agreement        81.0%" in typical.table()


def test_allow_requantize_requantizes_a_gguf(smollm2_path, tmp_path):
    out = tmp_path / "requantized.gguf"
    result = _edgechat("quantize", str(smollm2_path), "--allow-requantize", "--type", "Q4_0", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "edgechat: warning: requantizing an already quantized model loses quality" in result.stderr
    import gguf

    types = {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert "Q4_0" in types and "Q4_1" not in types


def test_bf16_rounding_matches_torch():
    """--outtype bf16 rounds to nearest even like torch (which wrote the checkpoints), NaN stays NaN."""
    import numpy as np
    import torch

    from quantize.convert import _to_bf16_bits

    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(10_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10_000),
        np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, 3.4e38], dtype=np.float32),
        # exact ties between two bf16 values: even mantissa wins
        (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
    ]).astype(np.float32)
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(_to_bf16_bits(values), expected)
    nan = _to_bf16_bits(np.array([np.nan], dtype=np.float32))
    assert np.isnan((nan.astype(np.uint32) << 16).view(np.float32)[0])


def test_hub_repo_id_from_the_offline_cache(smollm2, tmp_path):
    """A repo id resolves through the Hugging Face cache, offline, and names the output after the
    repo, not the cache's snapshot hash. In a fresh process: huggingface_hub reads its settings
    from the environment when first imported."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--Tiny-Model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    _copy_folder(smollm2, repo / "snapshots" / commit)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}

    def run(repo_id):
        return subprocess.run(
            [sys.executable, "-m", "edgechat", "quantize", repo_id, "--type", "Q8_0", "--no-report"],
            check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
        )

    result = run("someone/Tiny-Model")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "Tiny-Model-Q8_0.gguf").is_file()
    result = run("someone/Other-Model")
    assert result.returncode == 1
    assert "not in the Hugging Face cache and downloads are off" in result.stderr
