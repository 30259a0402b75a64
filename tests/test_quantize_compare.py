"""`edgechat quantize --compare` on real files: one model against itself, and against a coarse quantization."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quantize import convert
from tests.hf_fixtures import hf_checkpoint

pytestmark = pytest.mark.slow


def _compare(a, b, prompts, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgechat", "quantize", "--compare", str(a), str(b),
                           "--prompts", str(prompts), "--max-tokens", "12", *extra],
                          check=False, capture_output=True, text=True, timeout=600)


def test_compare_identical_and_different_models(tmp_path):
    folder = hf_checkpoint("smollm2-135m-instruct")
    f16 = convert(folder, tmp_path / "f16.gguf", type_name="F16").path
    coarse = convert(folder, tmp_path / "q2.gguf", type_name="Q2_K").path
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n\nWrite a Python function that adds two numbers.\n")

    same = _compare(f16, f16, prompts, "--json")
    assert same.returncode == 0, same.stderr
    report = json.loads(same.stdout)
    assert [r["diverges_at"] for r in report["prompts"]] == [None, None]
    assert all(r["answer_a"] == r["answer_b"] and r["answer_a"] for r in report["prompts"])
    assert report["summary"]["mean_kld"] < 1e-6 and report["summary"]["top1_agreement"] == 1.0

    different = _compare(f16, coarse, prompts)
    assert different.returncode == 0, different.stderr
    assert "first differs at answer token" in different.stdout
    assert "A: f16.gguf" in different.stdout and "B: q2.gguf" in different.stdout
    kld = float(different.stdout.split("mean KLD")[1].split()[0])
    assert kld > 0.05


def test_compare_needs_prompts(tmp_path):
    result = subprocess.run([sys.executable, "-m", "edgechat", "quantize", "--compare", "a.gguf", "b.gguf"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and result.stderr.strip() == "edgechat: error: --compare needs --prompts FILE (one prompt per line)"


def test_eval_during_a_conversion(tmp_path):
    """--eval answers the prompts with the F16 conversion and the result; --json keeps stdout to the JSON."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n")
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    result = subprocess.run([sys.executable, "-m", "edgechat", "quantize", str(hf_checkpoint("smollm2-135m-instruct")),
                             "--type", "Q8_0", "-o", str(out), "--no-report", "--eval", str(prompts), "--max-tokens",
                             "8", "--json"], check=False, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["a"].endswith("reference-F16.gguf") and report["b"] == str(out)
    assert [r["prompt"] for r in report["prompts"]] == ["What is the capital of France?"]
    assert report["prompts"][0]["answer_a"] and 0 <= report["summary"]["mean_kld"] < 0.05
    assert f"wrote {out}" in result.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]  # the F16 is gone


def test_eval_with_unreadable_prompts_converts_nothing(tmp_path):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n\n")
    result = subprocess.run([sys.executable, "-m", "edgechat", "quantize", str(hf_checkpoint("smollm2-135m-instruct")),
                             "-o", str(tmp_path / "m.gguf"), "--eval", str(empty)],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip() == f"edgechat: error: {empty} holds no prompts (one per line)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt"]
