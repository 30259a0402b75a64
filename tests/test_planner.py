"""The memory planner on the real models' metadata."""

from __future__ import annotations

import pytest

from edgechat.engine import Engine, EngineConfig, planner
from edgechat.errors import ModelTooLargeError, UsageError
from edgechat.models import read_model_info


def test_kv_formula_honours_gqa_sliding_window_and_type(smollm2_path, gemma3_path):
    smol = read_model_info(smollm2_path)
    # 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 2 bytes, per token
    assert smol.kv_cache_bytes(1) == 2 * 30 * 3 * 64 * 2
    gemma = read_model_info(gemma3_path)
    assert gemma.n_swa_layers == 15 and gemma.sliding_window == 512
    # full cache: all 18 layers; pruned: 3 global layers hold every token, 15 only their window
    assert gemma.kv_cache_bytes(8192, swa_full=True) == 2 * 18 * 1 * 256 * 2 * 8192
    assert gemma.kv_cache_bytes(8192) == 2 * 3 * 256 * 2 * 8192 + 2 * 15 * 256 * 2 * (512 + 512)
    assert smol.kv_cache_bytes(1000, planner.KV_BYTES["q8_0"]) < smol.kv_cache_bytes(1000) * 0.6


def test_default_context_is_the_largest_that_fits_capped(smollm2_path):
    info = read_model_info(smollm2_path)
    assert planner.choose_context(info, available=64 << 30).n_ctx == planner.DEFAULT_CTX_CAP
    tight = planner.plan_for(info, 1024, available=1).total
    # room for about 1k tokens, not 2k: the planner halves until it fits
    assert planner.choose_context(info, available=int(tight / planner.HEADROOM) + 1).n_ctx == 1024


def test_a_model_that_cannot_fit_is_refused_before_loading(smollm2_path, monkeypatch):
    monkeypatch.setattr(planner, "available_memory", lambda: 50 << 20)
    with pytest.raises(ModelTooLargeError) as err:
        Engine(EngineConfig(model=str(smollm2_path)))
    message = str(err.value)
    assert "MiB" in message and "smaller" in message and "\n" not in message


def test_context_beyond_training_is_a_usage_error(smollm2_path):
    with pytest.raises(UsageError, match="trained for \\(8192 tokens\\)"):
        planner.choose_context(read_model_info(smollm2_path), requested=16384)
