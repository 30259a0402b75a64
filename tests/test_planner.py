"""The memory planner on the real models' metadata."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edgechat.engine import Engine, EngineConfig
from edgechat.errors import ModelTooLargeError, UsageError
from edgechat.models import planner, read_model_info


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


def test_the_small_swa_cache_is_counted_and_chosen_only_where_the_full_one_does_not_fit(gemma3_path, smollm2_path):
    gemma = read_model_info(gemma3_path)
    full = planner.plan_for(gemma, 8192, available=64 << 30)
    small = planner.plan_for(gemma, 8192, available=64 << 30, swa_full=False)
    # 3 global layers keep 8192 cells, 15 sliding ones a 512-token window + one 512-token ubatch
    assert small.kv_cache == gemma.kv_cache_bytes(8192) == 2 * 256 * 2 * (3 * 8192 + 15 * 1024)
    assert 3 < full.kv_cache / small.kv_cache < 5
    # four sequences: a window each, one ubatch, in multiples of 256 cells
    assert gemma.kv_cache_bytes(4 * 4096, n_seq=4) == 2 * 256 * 2 * (3 * 4 * 4096 + 15 * 2560)
    between = int((small.total + full.total) / 2 / planner.HEADROOM)
    assert planner.choose_context(gemma, 8192, available=64 << 30).swa_full
    assert not planner.choose_context(gemma, 8192, available=between).swa_full
    assert not planner.choose_context(gemma, 8192, available=64 << 30, swa="small").swa_full
    with pytest.raises(ModelTooLargeError):
        planner.choose_context(gemma, 8192, available=between, swa="full")
    # a model without sliding layers has one cache only
    smol = read_model_info(smollm2_path)
    assert planner.plan_for(smol, 4096, swa_full=False).swa_full


def test_a_small_swa_cache_answers_as_the_full_one_and_recomputes_a_rewind_past_its_window(gemma3_path, isolated_dirs):
    from neartie import assert_same_tokens_or_near_tie

    from edgechat.engine.types.request import ChatRequest
    from edgechat.params import SamplingParams

    words = "the tide comes in and the gulls call over the harbour wall while boats rock at anchor".split()
    long_text = " ".join(words[i % len(words)] + (f" {i}" if i % 7 == 0 else "") for i in range(1100))
    # the third continues the text's pattern past the window: n-gram lookup drafts there
    prompts = [long_text, long_text[:600] + " and then, far from the sea, the town", long_text + " the tide comes in"]
    answers = {}
    for swa in ("full", "small"):
        with Engine(EngineConfig(model=str(gemma3_path), n_ctx=2048, swa_cache=swa, paths=isolated_dirs)) as engine:
            assert engine.plan.swa_full is (swa == "full") and engine.backend.can_shift is (swa == "full")
            # the second prompt shares ~150 tokens with the first: reusing them needs the window
            # before them, which the small cache has overwritten, so it recomputes
            answers[swa] = []
            for p, spec in zip(prompts, ("off", "off", "lookup"), strict=True):
                request = ChatRequest(prompt=p, sampling=SamplingParams(temperature=0), max_tokens=12 if spec == "off" else 40,
                                      speculative=spec)
                answers[swa].append(engine.submit(request).result())
                # past the window, the small cache's sliding layers hold only its last cells: consistent all the same
                assert engine.kv_problems() == []
            if swa == "small":
                # the small cache's attention runs in other shapes (and drafts rolled back past the
                # window): the full cache's answers, or parted where the top logits nearly tie
                for p, full, small in zip(prompts, answers["full"], answers["small"], strict=True):
                    assert_same_tokens_or_near_tie(engine, engine.prompt_tokens(ChatRequest(prompt=p)), full.token_ids, small.token_ids)
    assert answers["full"][1].metrics.cached_tokens > 100 and answers["small"][1].metrics.cached_tokens == 0
    # that refused rewind does not turn speculation off: drafts are rolled back within the window
    assert answers["small"][2].metrics.drafted_tokens > 0, answers["small"][2].metrics


def test_an_answer_past_the_context_on_a_small_swa_cache_says_why_it_recomputes(gemma3_path, isolated_dirs):
    from edgechat.engine.types.request import ChatRequest, Evicted
    from edgechat.params import SamplingParams

    words = "the tide comes in and the gulls call over the harbour wall while boats rock at anchor".split()
    text = " ".join(words[i % len(words)] + (f" {i}" if i % 7 == 0 else "") for i in range(600))
    with Engine(EngineConfig(model=str(gemma3_path), n_ctx=1536, swa_cache="small", paths=isolated_dirs)) as engine:
        assert not engine.backend.can_shift
        handle = engine.submit(ChatRequest(prompt=text, sampling=SamplingParams(temperature=0), max_tokens=1000, ignore_eos=True))
        evicted = [e for e in handle.events() if isinstance(e, Evicted)]
        assert handle.finished.reason == "length"
        assert evicted and evicted[0].policy == "truncate" and "cannot shift" in evicted[0].note, evicted
        assert engine.kv_problems() == []


#: a fresh process loads the model at a 32k context and reads a prompt of at least one full ubatch
#: (512 tokens: the compute buffer in use); its peak RSS less what it held before the load
_LOAD_AND_MEASURE = """
import json, sys
from pathlib import Path
from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.models import planner

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

before = status("VmRSS")
with Engine(EngineConfig(model=sys.argv[1], n_ctx=32768, n_parallel=1, kv_type=sys.argv[2], speculative="off")) as engine:
    done = engine.submit(ChatRequest(prompt=Path(planner.__file__).read_text()[:3000], max_tokens=1)).result()
    print(json.dumps({"growth": status("VmHWM") - before, "planned": engine.plan.total, "prompt": done.metrics.prompt_tokens}))
"""


def test_the_plan_is_what_a_real_load_at_32k_takes_as_the_os_counts_it(qwen_coder_path):
    # flash attention (auto: on for the CPU) keeps no attention scores: a plan that counted them
    # (as without it) asked for 1.9 GB here, and refused 32k contexts that fit
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_MEASURE, str(qwen_coder_path), "f16"], capture_output=True, text=True,
                         timeout=900, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["prompt"] >= 512
    assert 0.95 <= seen["growth"] / seen["planned"] <= 1.05, seen
    info = read_model_info(qwen_coder_path)
    assert planner.plan_for(info, 32768, flash_attn="off").compute > 10 * planner.plan_for(info, 32768).compute
