"""Images through the whole engine on the tiny M-RoPE pair (tests/tiny_qwen2vl.py: a Qwen2-VL
layout text model with SmolLM2's tokenizer and a qwen2vl_merger projector, random weights).

An M-RoPE image's cells all sit at one position P and the text after it resumes at P + n_pos, so
a slot maps mirror indexes to positions (KVManager, `Slot.runs`). What it proves, as
tests/test_vision_engine.py does for the LLaVA layout: a picture reaches the model and gives the
same answer each time; the next turn reuses its cells without encoding it again; another picture
never matches; a full context recomputes (this cache cannot shift) with the image whole or gone;
a snapshot brings it back in a new engine; and `kv_problems()`, which compares each mirror's
positions with llama.cpp's own cells, stays empty. Nothing here reads meaning into an answer.
"""

from __future__ import annotations

import pytest
from test_vision import prefill
from test_vision_engine import QUESTION, ask, sentinel_runs, user
from tiny_mmproj import CHECKS, GRADIENT
from tiny_qwen2vl import tokens_per_side, write_tiny_qwen2vl, write_tiny_qwen2vl_mmproj

from edgechat.engine import ChatRequest, ContextPolicy, Engine, EngineConfig, Evicted, ImageInput
from edgechat.engine.output.logprobs import token_logprobs
from edgechat.engine.runners.llama import LlamaBackend
from edgechat.engine.runners.media import Projector
from edgechat.models.planner import default_threads

#: GRADIENT and CHECKS are 40x40: 5x5 image tokens at one position, taking 5 positions
SIDE = tokens_per_side(40)
N_CELLS, N_POS = SIDE * SIDE, SIDE


@pytest.fixture(scope="module")
def model(smollm2_path, tmp_path_factory):
    return write_tiny_qwen2vl(tmp_path_factory.mktemp("qwen2vl") / "tiny-qwen2vl.gguf", smollm2_path)


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    return write_tiny_qwen2vl_mmproj(tmp_path_factory.mktemp("qwen2vl-mmproj") / "mmproj.gguf")


def config(model, mmproj, models_root, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), paths=models_root, mmproj=str(mmproj), **kw)


@pytest.fixture(scope="module")
def vision(model, mmproj, models_root):
    with Engine(config(model, mmproj, models_root, n_ctx=1024, n_parallel=2)) as engine:
        yield engine


def image_at(tokens: list[int]) -> int:
    return next(i for i, t in enumerate(tokens) if t < 0)


def assert_positions(engine: Engine, session: str) -> None:
    """The slot's map puts the image at one position and the text after it n_pos later, and
    llama.cpp's cells agree (kv_problems reads them)."""
    slot = engine.kv.slot_of(session)
    if sentinel_runs(slot.tokens):
        start = image_at(slot.tokens)
        assert slot.runs == [(start, N_CELLS, N_POS)]
        assert slot.next_pos == len(slot.tokens) - N_CELLS + N_POS
    else:
        assert slot.runs == [] and slot.next_pos == len(slot.tokens)
    assert engine.kv_problems() == []


def answer(done) -> list[tuple[int, float, list[int]]]:
    return [(lp.id, lp.logprob, lp.top_ids) for lp in done.logprobs]


def test_the_engine_puts_an_mrope_image_and_the_text_after_it_where_mtmd_does(model, mmproj, models_root):
    # the reference: the same cells decoded at the positions mtmd gives them (test_vision.prefill,
    # the next text at the image's position + n_pos); text after the image at any other position
    # (its mirror index, say) gives other logits
    messages = [user(ImageInput(GRADIENT), QUESTION)]
    with Engine(config(model, mmproj, models_root, n_ctx=1024, deterministic=True)) as engine:
        done, _ = ask(engine, messages, n=1, logprobs=5)
        mirror = engine.prompt_tokens(ChatRequest(messages=messages))
        assert engine.kv_problems() == []
    start = image_at(mirror)
    backend = LlamaBackend(model, n_ctx_total=512, n_seq_max=1, n_threads=default_threads())
    projector = Projector(backend, mmproj)
    try:
        media = next(c for c in projector.chunks(projector.marker, [projector.image(GRADIENT)], add_special=False) if not isinstance(c, list))
        pos, index = prefill(backend, projector, [mirror[:start], media, mirror[start + N_CELLS :]], 0)
        assert pos == len(mirror) - N_CELLS + N_POS
        logprob, top = token_logprobs(backend.logits(index), done.logprobs[0].id, 5)
    finally:
        projector.close()
        backend.close()
    assert done.logprobs[0].id == top[0][0]
    assert done.logprobs[0].logprob == pytest.approx(logprob, abs=1e-3)


def test_an_mrope_image_changes_the_answer_and_the_same_image_gives_the_same_one(model, mmproj, models_root):
    # deterministic: each prompt prefilled from an empty cache, so equal answers mean equal inputs
    with Engine(config(model, mmproj, models_root, n_ctx=1024, deterministic=True)) as engine:
        assert engine.modalities == ("vision",) and engine.projector.mrope
        # random weights answer newlines whatever they read: the first token's log probabilities
        # tell what reached the model
        text, _ = ask(engine, [{"role": "user", "content": QUESTION}], logprobs=5)
        first, _ = ask(engine, [user(ImageInput(GRADIENT, "image/png"), QUESTION)], logprobs=5)
        again, _ = ask(engine, [user(ImageInput(GRADIENT), QUESTION)], logprobs=5)
        other, _ = ask(engine, [user(ImageInput(CHECKS), QUESTION)], logprobs=5)
        assert answer(first) == answer(again)
        assert answer(first) != answer(text)
        assert answer(other) != answer(first)
        # usage counts the image's cells (not its positions) as prompt tokens, with the
        # <|vision_start|> / <|vision_end|> text mtmd puts around it
        extra = first.metrics.prompt_tokens - text.metrics.prompt_tokens
        assert N_CELLS < extra < N_CELLS + 16
        prompt = engine.prompt_tokens(ChatRequest(messages=[user(ImageInput(GRADIENT), QUESTION)]))
        assert first.metrics.prompt_tokens == len(prompt) and sentinel_runs(prompt) == [N_CELLS]
        assert engine.projector.encodes == 3
        assert engine.kv_problems() == []


def test_the_next_turn_reuses_the_mrope_image_without_encoding_it_again(vision):
    before = vision.projector.encodes
    messages = [user(ImageInput(GRADIENT), QUESTION)]
    first, _ = ask(vision, messages, session="reuse")
    assert vision.projector.encodes == before + 1
    assert_positions(vision, "reuse")
    slot = vision.kv.slot_of("reuse")
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Say more."}]
    second, _ = ask(vision, messages, session="reuse")
    assert vision.projector.encodes == before + 1  # not encoded again
    assert second.metrics.cached_tokens >= image_at(slot.tokens) + N_CELLS  # the cache covers the image
    # all of the first prompt but its last token: the answer's newlines tokenize with it
    assert second.metrics.cached_tokens >= first.metrics.prompt_tokens - 1
    assert_positions(vision, "reuse")


def test_a_different_picture_never_matches_a_cached_mrope_image(vision):
    ask(vision, [user(ImageInput(GRADIENT), QUESTION)])
    prompt = vision.prompt_tokens(ChatRequest(messages=[user(ImageInput(CHECKS), QUESTION)]))
    before = vision.projector.encodes
    other, _ = ask(vision, [user(ImageInput(CHECKS), QUESTION)])
    assert other.metrics.cached_tokens <= image_at(prompt)
    assert vision.projector.encodes == before + 1
    assert vision.kv_problems() == []


def test_two_mrope_images_in_one_message_each_take_their_positions(vision):
    done, _ = ask(vision, [user("Compare", ImageInput(GRADIENT), "with", ImageInput(CHECKS), "please.")], session="two")
    slot = vision.kv.slot_of("two")
    assert sentinel_runs(slot.tokens) == [N_CELLS, N_CELLS]
    assert [(n, p) for _, n, p in slot.runs] == [(N_CELLS, N_POS), (N_CELLS, N_POS)]
    assert slot.next_pos == len(slot.tokens) - 2 * (N_CELLS - N_POS)
    assert vision.kv_problems() == []


def test_a_full_context_evicts_the_mrope_image_whole(model, mmproj, models_root):
    with Engine(config(model, mmproj, models_root, n_ctx=256)) as engine:
        assert not engine.kv.can_shift  # an M-RoPE cache: eviction always recomputes
        messages = [{"role": "system", "content": "You are brief."}, user(ImageInput(GRADIENT), QUESTION)]
        evicted = []
        for turn in range(14):
            done, events = ask(engine, messages, session="long", n=16)
            evicted += [e for e in events if isinstance(e, Evicted)]
            assert sentinel_runs(engine.kv.slot_of("long").tokens) in ([N_CELLS], [])
            assert_positions(engine, "long")
            if evicted and not sentinel_runs(engine.kv.slot_of("long").tokens):
                break
            messages += [{"role": "assistant", "content": done.text},
                         {"role": "user", "content": f"Tell me a long story about the number {turn}, in detail."}]
        assert evicted, "the conversation outgrew the context without evicting"
        assert sentinel_runs(engine.kv.slot_of("long").tokens) == []


@pytest.mark.parametrize("policy", [ContextPolicy.TRUNCATE, ContextPolicy.SHIFT])
def test_a_full_context_mid_answer_recomputes_with_the_mrope_image_whole(model, mmproj, models_root, policy):
    # the answer outgrows the context: what follows the cut is recomputed (this cache cannot
    # shift, whatever the policy asks), a later message's image encoded again
    with Engine(config(model, mmproj, models_root, n_ctx=160)) as engine:
        messages = [{"role": "user", "content": "Hello there, how are you today?"},
                    {"role": "assistant", "content": "I am fine, thank you."},
                    user(ImageInput(GRADIENT), QUESTION)]
        done, events = ask(engine, messages, session="cut", n=150, context_policy=policy, ignore_eos=True)
        assert any(isinstance(e, Evicted) for e in events)
        assert done.metrics.completion_tokens == 150
        if policy is ContextPolicy.TRUNCATE:  # the cut falls before the image: it is recomputed
            assert engine.projector.encodes >= 2
        assert sentinel_runs(engine.kv.slot_of("cut").tokens) in ([N_CELLS], [])
        assert_positions(engine, "cut")


def test_a_snapshot_restores_the_mrope_image_in_a_new_engine(model, mmproj, models_root):
    cfg = config(model, mmproj, models_root, n_ctx=1024)
    messages = [user(ImageInput(GRADIENT), QUESTION)]
    with Engine(cfg) as engine:
        first, _ = ask(engine, messages, session="snap")
        engine.release_session("snap")
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the colours?"}]
    with Engine(cfg) as engine:  # a new engine: the cells, and their positions, come from the snapshot
        second, _ = ask(engine, messages, session="snap")
        assert engine.projector.encodes == 0
        assert second.metrics.cached_tokens >= first.metrics.prompt_tokens - 1
        assert_positions(engine, "snap")


def test_the_prompt_cache_restores_an_mrope_image_prompt(model, mmproj, models_root):
    with Engine(config(model, mmproj, models_root, n_ctx=512, prompt_cache_budget=64 << 20)) as engine:
        image_prompt = [{"role": "system", "content": "Look closely."}, user(ImageInput(GRADIENT), QUESTION)]
        first, _ = ask(engine, image_prompt)
        ask(engine, [{"role": "user", "content": "Something else entirely: name three rivers."}])
        again, _ = ask(engine, image_prompt)
        assert again.metrics.prompt_cache_hit
        assert again.metrics.restored_tokens >= first.metrics.prompt_tokens - 1
        assert engine.projector.encodes == 1
        assert again.token_ids == first.token_ids
        assert engine.kv_problems() == []
