"""The engine on the real embedded models: answers, sampling, cancellation, stops, UTF-8, templates."""

from __future__ import annotations

import threading

import pytest
from conftest import GREEDY
from neartie import assert_same_or_near_tie

from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams, TextDelta
from edgechat.engine.output.stream import OutputProcessor
from edgechat.engine.prompt.templates import choose_format
from edgechat.errors import InvalidFieldError, PromptTooLongError, UsageError


@pytest.fixture(scope="module")
def smol_config() -> dict:
    return {"n_ctx": 2048}


def ask(engine, text, **kw):
    kw.setdefault("sampling", GREEDY)
    return engine.submit(ChatRequest(messages=[{"role": "user", "content": text}], **kw)).result()


def test_greedy_answer_through_the_models_own_template(smol):
    assert smol.template_mode == "chat"
    done = ask(smol, "What is the capital of France? Answer in one word.", max_tokens=16)
    assert "Paris" in done.text
    assert done.reason == "stop"
    m = done.metrics
    assert m.prompt_tokens > 20 and m.completion_tokens == len(done.token_ids) > 0
    assert m.ttft > 0 and m.prefill_tps > 0 and m.queue_wait >= 0 and m.total >= m.ttft


def test_greedy_is_deterministic(smol):
    a = ask(smol, "Name three colors.", max_tokens=24)
    b = ask(smol, "Name three colors.", max_tokens=24)
    assert a.text == b.text and a.token_ids == b.token_ids


def test_same_seed_same_text_and_seeds_matter(smol):
    hot = dict(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0)
    runs = [ask(smol, "Tell me a story about a cat.", max_tokens=32, sampling=SamplingParams(seed=s, **hot)).text for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_p_zero_keeps_only_the_most_likely_token_and_a_zero_repeat_penalty_is_refused(smol):
    """The ends of the one table of sampling limits (edgechat/params.py) on the real model: top_p 0
    (which OpenAI takes) is greedy at any temperature; a repeat penalty of 0 would divide by zero."""
    greedy = ask(smol, "Tell me a story about a cat.", max_tokens=24)
    for seed in (7, 8):
        nucleus = ask(smol, "Tell me a story about a cat.", max_tokens=24,
                      sampling=SamplingParams(temperature=1.5, top_k=0, top_p=0.0, min_p=0.0, seed=seed))
        assert nucleus.token_ids == greedy.token_ids
    with pytest.raises(InvalidFieldError, match=r"repeat_penalty must be above 0") as err:
        ask(smol, "hi", sampling=SamplingParams(repeat_penalty=0.0))
    assert err.value.param == "repeat_penalty" and smol.stats()["running"] == 0


def test_max_tokens_and_ignore_eos(smol):
    done = ask(smol, "Say hi.", max_tokens=40, ignore_eos=True)
    assert done.reason == "length" and done.metrics.completion_tokens == 40
    assert done.metrics.decode_tps > 0 and done.metrics.tpot_p95 >= done.metrics.tpot_p50 > 0


def test_cancel_from_another_thread_stops_within_one_token(smol):
    seen = 0
    at_cancel = []
    lock = threading.Lock()
    started = threading.Event()

    def on_event(ev):
        nonlocal seen
        if isinstance(ev, TextDelta):
            with lock:
                seen += 1
            if seen >= 5:
                started.set()

    handle = smol.submit(
        ChatRequest(messages=[{"role": "user", "content": "Count to one thousand."}], sampling=GREEDY, max_tokens=2000, ignore_eos=True),
        on_event=on_event,
    )
    assert started.wait(60)
    with lock:
        handle.cancel()
        at_cancel.append(handle_tokens := seen)
    done = handle.result(timeout=60)
    assert done.reason == "cancelled"
    # deltas can lag tokens by held-back bytes, never by more than the one token in flight
    assert done.metrics.completion_tokens <= handle_tokens + 2
    assert smol.stats()["running"] == 0


def test_stop_string_cuts_exactly(smol):
    full = ask(smol, "Write a short poem about the sea.", max_tokens=48, ignore_eos=True).text
    words = full.split()
    stop = words[len(words) // 2]
    cut = full[: full.index(stop)]
    done = ask(smol, "Write a short poem about the sea.", max_tokens=48, ignore_eos=True, stop=[stop])
    assert done.reason == "stop"
    assert done.text == cut
    assert stop not in done.text


def test_streamed_text_equals_the_whole_answer(smol):
    handle = smol.submit(ChatRequest(messages=[{"role": "user", "content": "Write a Python function that adds two numbers, then say 你好 and add an emoji 🎉."}],
                                     sampling=GREEDY, max_tokens=80))
    parts = [ev.text for ev in handle if isinstance(ev, TextDelta)]
    done = handle.finished
    assert "".join(parts) == done.text
    assert done.text == smol.detokenize(done.token_ids)


@pytest.mark.parametrize("text", ["你好，世界！今天天气很好。", "emoji: 🎉🚀👩‍👩‍👧 done", "def f(x):\n    return x ** 2  # 平方\n"])
def test_utf8_pieces_are_held_until_whole(smol, gemma, text):
    for engine in (smol, gemma):
        tokens = engine.tokenize(text)
        proc = OutputProcessor()
        out = []
        for tok in tokens:
            chunk = proc.feed(engine.backend.piece(tok))
            chunk.encode("utf-8")  # never a lone surrogate or half character
            assert "\ufffd" not in chunk
            out.append(chunk)
        out.append(proc.finish())
        assert "".join(out) == engine.detokenize(tokens)


def test_a_character_cut_at_any_byte_is_held_back_not_replaced():
    """An answer that ends mid-character (max_tokens in the middle of a multi-byte UTF-8
    sequence) ends at the last whole character, never with U+FFFD."""
    for char in "é€한🎉":
        whole = char.encode()
        for cut in range(1, len(whole)):
            proc = OutputProcessor()
            emitted = proc.feed(b"ok " + whole[:cut]) + proc.finish()
            assert emitted == proc.text == "ok ", (char, cut)


def test_output_processor_splits_bytes_and_holds_only_possible_stops():
    data = "价格是 42 元 🎉 END tail".encode()
    proc = OutputProcessor(stop=["END"])
    emitted, held = [], []
    for i in range(len(data)):
        emitted.append(proc.feed(data[i : i + 1]))
        if not proc.stopped:
            # only what could still become "END" is held back, never other text
            assert "END".startswith(proc._held) and len(proc._held) < 3, proc._held
            held.append(proc._held)
    assert held.count("E") == 1 and held.count("EN") == 1
    emitted.append(proc.finish())
    assert "".join(emitted) == "价格是 42 元 🎉 "
    assert proc.stopped


def test_gemma_without_template_uses_its_family_format(gemma):
    assert gemma.template_mode == "family:gemma3"
    assert "no chat template" in gemma.template_warning
    req = ChatRequest(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    tokens = gemma.prompt_tokens(req)
    text = gemma.backend.detokenize(tokens, special=True)
    assert tokens[0] == gemma.backend.bos and tokens[1] != gemma.backend.bos  # BOS exactly once
    assert "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n" in text
    done = gemma.submit(ChatRequest(messages=[{"role": "user", "content": "The capital of France is"}], sampling=GREEDY, max_tokens=12)).result()
    assert done.metrics.completion_tokens > 0


def test_unknown_family_without_template_is_plain_completion_with_a_warning():
    fmt = choose_format(None, "llama", "<s>", "</s>", has_token=lambda t: False)
    assert fmt.mode == "completion" and "completion" in fmt.warning
    chatml = choose_format(None, "qwen2", "", "", has_token=lambda t: t == "<|im_start|>")
    assert chatml.mode == "family:chatml"


def test_prompt_over_the_limit_is_refused_before_compute(smol):
    long = "word " * 3000
    with pytest.raises(PromptTooLongError) as err:
        smol.submit(ChatRequest(messages=[{"role": "user", "content": long}], max_tokens=100))
    assert err.value.prompt_tokens > err.value.limit
    assert str(err.value.prompt_tokens) in str(err.value) and str(err.value.limit) in str(err.value)
    assert "--ctx" in str(err.value)
    assert smol.stats()["running"] == 0


@pytest.mark.parametrize(
    "req",
    [
        ChatRequest(messages=[{"role": "user", "content": "   "}]),
        ChatRequest(messages=[]),
        ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=0),
        ChatRequest(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(temperature=-1)),
        ChatRequest(messages=[{"role": "robot", "content": "hi"}]),
        ChatRequest(prompt=""),
    ],
)
def test_bad_requests_are_usage_errors(smol, req):
    with pytest.raises(UsageError):
        smol.submit(req)


def test_parallel_requests_are_batched_and_match_sequential_answers(smollm2_path, models_root):
    prompts = ["What is 2+2?", "Name a fruit.", "What color is the sky?"]
    with Engine(EngineConfig(model=str(smollm2_path), n_ctx=1024, n_parallel=3, paths=models_root)) as engine:
        # speculation off: this is about batching alone
        alone = [ask(engine, p, max_tokens=24, ignore_eos=True, speculative="off").token_ids for p in prompts]
        before = engine.stats()["decode_calls"]
        handles = [engine.submit(ChatRequest(messages=[{"role": "user", "content": p}], sampling=GREEDY, max_tokens=24,
                                             ignore_eos=True, speculative="off")) for p in prompts]
        together = [h.result().token_ids for h in handles]
        calls = engine.stats()["decode_calls"] - before
        assert engine.stats()["running"] == 0 and engine.kv_problems() == []
        # one llama_decode per step served all three: one sequence after another would take 3 x 24
        assert calls <= 24 + 2, calls
        # and batching computes the same greedy answers, whole, or parts from them at a near-tie
        for p, a, b in zip(prompts, alone, together, strict=True):
            assert_same_or_near_tie(engine, [{"role": "user", "content": p}], a, b)


def test_load_progress_is_reported_and_a_failing_reporter_does_not_abort_the_load(gemma3_path, isolated_dirs):
    seen: list[float] = []
    with Engine(EngineConfig(model=str(gemma3_path), n_ctx=256, paths=isolated_dirs,
                             on_load_progress=seen.append)):
        pass
    assert len(seen) > 2 and seen == sorted(seen) and seen[-1] == pytest.approx(1.0)

    def broken(fraction: float) -> None:
        raise RuntimeError("a UI that went away")

    with Engine(EngineConfig(model=str(gemma3_path), n_ctx=256, paths=isolated_dirs,
                             on_load_progress=broken)) as engine:
        assert engine.submit(ChatRequest(prompt="The sky is", max_tokens=2)).result().reason == "length"
