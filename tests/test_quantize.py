"""edgechat quantize on real checkpoints: SmolLM2 (llama, BPE) and Gemma 3 (SentencePiece, 262k vocab).

Each checkpoint is converted once per module; the expensive references (transformers' forward
pass, llama.cpp's own quantizer) run once per model.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from quantize import convert
from quantize.convert import pick_type_for_size, plan_types, _order
from quantize.architecture import family_for
from quantize.llm import Model
from quantize.mixture import FILE_TYPES
from quantize.safetensors import Checkpoint
from quantize.source import read_config
from tests.hf_fixtures import hf_checkpoint

pytestmark = pytest.mark.slow

MODELS = ["smollm2-135m-instruct", "gemma3-270m"]

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "我想在苹果公司工作，今天的天气很好。",
    "Emoji: 🚀🦙 😶‍🌫️ ✅ done",
    "def f(x):\n    return x**2  # square\n\n\n\tindented",
    "   many   spaces    and\n\n\nnewlines  \n ",
    "3 33 333 3333 3.14 1,000,000",
    "Ünïcödé çà et là — «quotes» ‘single’ I've, you'RE",
]

LOGIT_TEXT = (
    "The lighthouse keeper wrote in his log every evening, even when nothing had happened. "
    "城市的早晨总是从一杯热豆浆开始。街角的小店六点就开门了。\n"
    "def moving_average(values, window):\n    total = sum(values[:window])\n    return total / window\n"
) * 6


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """model -> {"F16": path, "Q4_K_M": path}, converted lazily, once per module."""
    out = tmp_path_factory.mktemp("quantized")
    cache: dict[tuple[str, str], object] = {}

    def get(model: str, type_name: str):
        if (model, type_name) not in cache:
            cache[model, type_name] = convert(hf_checkpoint(model), out / f"{model}-{type_name}.gguf", type_name=type_name).path
        return cache[model, type_name]

    return get


@pytest.mark.parametrize("model", MODELS)
def test_tokenization_matches_hugging_face(model, converted):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_checkpoint(model))
    with Model(converted(model, "F16"), vocab_only=True) as ours:
        for text in CORPUS:
            assert ours.tokenize(text, add_special=True) == hf(text, add_special_tokens=True)["input_ids"], text


@pytest.mark.parametrize("model", MODELS)
def test_f16_logits_match_transformers(model, converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = hf_checkpoint(model)
    ids = AutoTokenizer.from_pretrained(folder)(LOGIT_TEXT, add_special_tokens=True)["input_ids"][:320]
    assert len(ids) >= 300
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    del hf
    with Model(converted(model, "F16"), n_ctx=512) as ours:
        got = np.concatenate([logits for _, logits in ours.logits(ids)])
    assert got.shape == expected.shape
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.99
    # F16 rounding of bf16 weights moves logits a little, never by much next to their spread
    assert np.abs(got - expected).max() < 0.05 * expected.std()


def _tensors(path):
    import gguf

    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("model", MODELS)
def test_q4_k_m_is_byte_identical_to_llama_cpp(model, converted, tmp_path):
    import llama_cpp

    reference = tmp_path / "llama-cpp-Q4_K_M.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(FILE_TYPES["Q4_K_M"].ftype)
    assert llama_cpp.llama_model_quantize(
        str(converted(model, "F16")).encode(), str(reference).encode(), ctypes.byref(params)
    ) == 0
    ours, theirs = _tensors(converted(model, "Q4_K_M")), _tensors(reference)
    assert list(ours) == list(theirs)  # same tensors, in the same order
    assert {n: t.tensor_type for n, t in ours.items()} == {n: t.tensor_type for n, t in theirs.items()}
    assert {t.tensor_type.name for t in ours.values()} >= {"Q4_K", "Q6_K", "Q8_0"}
    for name, tensor in ours.items():
        assert np.array_equal(tensor.data.view(np.uint8), theirs[name].data.view(np.uint8)), name


def test_type_mixtures_match_llama_cpp(converted, tmp_path):
    """The other file types choose each tensor's type as llama.cpp does (types only; the kernels are shared)."""
    import llama_cpp

    folder = hf_checkpoint("smollm2-135m-instruct")
    family = family_for(folder, read_config(folder))
    f16 = str(converted("smollm2-135m-instruct", "F16")).encode()
    with Checkpoint(folder) as checkpoint:
        planned = _order(family.plan(checkpoint))
        for name in ("Q4_K_S", "Q5_K_M", "Q4_0"):
            out = tmp_path / f"{name}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = int(FILE_TYPES[name].ftype)
            assert llama_cpp.llama_model_quantize(f16, str(out).encode(), ctypes.byref(params)) == 0
            expected = {n: t.tensor_type for n, t in _tensors(out).items()}
            assert plan_types(family, planned, FILE_TYPES[name], FILE_TYPES["F16"].default) == expected, name
            out.unlink()


def test_target_size_picks_the_best_type_that_fits():
    folder = hf_checkpoint("smollm2-135m-instruct")
    family = family_for(folder, read_config(folder))
    f16 = FILE_TYPES["F16"].default
    with Checkpoint(folder) as checkpoint:
        planned = _order(family.plan(checkpoint))
        from quantize.convert import output_size

        sizes = {t: output_size(planned, plan_types(family, planned, FILE_TYPES[t], f16)) for t in ("Q5_K_M", "Q4_K_M")}
        assert pick_type_for_size(family, planned, f16, sizes["Q4_K_M"] + 1000) == "Q4_K_M"
        assert pick_type_for_size(family, planned, f16, sizes["Q5_K_M"]) == "Q5_K_M"


def test_q4_k_m_answers_through_its_chat_template(converted):
    """The chat template travels into the GGUF and the quantized model answers through it."""
    import llama_cpp

    with Model(converted("smollm2-135m-instruct", "Q4_K_M"), n_ctx=512, n_batch=128) as model:
        template = model.chat_template()
        assert template is not None and "<|im_start|>" in template
        messages = (llama_cpp.llama_chat_message * 1)()
        messages[0].role, messages[0].content = b"user", b"What is the capital of France?"
        buf = ctypes.create_string_buffer(2048)
        n = llama_cpp.llama_chat_apply_template(template.encode(), messages, 1, True, buf, len(buf))
        prompt = buf.raw[:n].decode()
        assert prompt.rstrip().endswith("<|im_start|>assistant")
        tokens = model.tokenize(prompt, add_special=True, parse_special=True)
        eos = llama_cpp.llama_vocab_eos(model.vocab)
        answer = []
        for _ in range(24):  # greedy, re-reading the whole short sequence each step
            last = None
            for _, logits in model.logits(tokens):
                last = logits[-1]
            token = int(last.argmax())
            if token == eos:
                break
            answer.append(token)
            tokens.append(token)
        text = b"".join(model.piece(t) for t in answer).decode("utf-8", "replace")
    assert "Paris" in text
