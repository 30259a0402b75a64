"""Images through the whole engine (prompt builder, scheduler, KV manager) on the embedded SmolLM2
with the tiny projector tests/tiny_mmproj.py writes (random weights, 16 cells per picture), and
on Gemma 3 270M with the gemma3-layout one (non-causal image cells).

What it proves: a picture in a message reaches the model (the greedy answer changes) and gives
the same answer each time; its cells are a cached prefix the next turn reuses without encoding
it again (counted on the projector), while another picture of the same size never matches; an
image leaves the context with its message, is saved and restored with its conversation's
snapshot and the prompt cache, and is re-encoded when its cells must be recomputed; the encode
runs on the encoder thread; the KV mirrors agree with llama.cpp's cells throughout. It says
nothing of what a picture shows: no test reads meaning into the answers. With
$EDGECHAT_TEST_VISION_MODEL and $EDGECHAT_TEST_VISION_MMPROJ set (conftest.py `vision_pair`), the
tests written for the tiny pair run on that model and projector instead.
"""

from __future__ import annotations

import threading

import pytest
from conftest import GREEDY
from tiny_mmproj import CHECKS, GRADIENT, N_IMAGE_TOKENS, png, text_embedding_width, write_tiny_mmproj

from edgechat.engine import ChatRequest, ContextPolicy, Engine, EngineConfig, Evicted, ImageInput
from edgechat.engine.runners.media import Projector
from edgechat.errors import UsageError

QUESTION = "What is in this picture?"
ANSWER_TOKENS = 12


def vision_config(pair, n_ctx: int, **kw) -> EngineConfig:
    # a context sized for the tiny projector's 16 cells grows by a real projector's extra cells
    return EngineConfig(model=str(pair.model), mmproj=str(pair.mmproj), n_ctx=n_ctx + pair.image_tokens - N_IMAGE_TOKENS, **kw)


@pytest.fixture(scope="module")
def vision(vision_pair, models_root):
    with Engine(vision_config(vision_pair, 1024, paths=models_root, n_parallel=2)) as engine:
        yield engine


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


def ask(engine: Engine, messages: list[dict], session: str | None = None, n: int = ANSWER_TOKENS, **kw):
    events = list(engine.submit(ChatRequest(messages=messages, sampling=GREEDY, max_tokens=n, session=session, **kw)))
    done = events[-1]
    assert done.error is None, done.error
    return done, events


def sentinel_runs(tokens: list[int]) -> list[int]:
    """Lengths of the runs of image cells in a mirror."""
    runs, n = [], 0
    for t in tokens + [0]:
        if t < 0:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_an_image_changes_the_answer_and_the_same_image_gives_the_same_one(vision_pair, models_root):
    # deterministic: each prompt prefilled from an empty cache, so equal answers mean equal inputs
    config = vision_config(vision_pair, 1024, paths=models_root, deterministic=True)
    with Engine(config) as engine:
        text, _ = ask(engine, [{"role": "user", "content": QUESTION}])
        first, _ = ask(engine, [user(ImageInput(GRADIENT, "image/png"), QUESTION)])
        again, _ = ask(engine, [user(ImageInput(GRADIENT), QUESTION)])
        other, _ = ask(engine, [user(ImageInput(CHECKS), QUESTION)])
        assert first.token_ids == again.token_ids
        assert first.token_ids != text.token_ids
        assert other.token_ids != first.token_ids
        # usage counts the image's cells as prompt tokens
        assert first.metrics.prompt_tokens == text.metrics.prompt_tokens + vision_pair.image_tokens
        assert engine.projector.encodes == 3
        assert engine.kv_problems() == []


def test_the_next_turn_reuses_the_image_cells_without_encoding_it_again(vision, vision_pair):
    before = vision.projector.encodes
    messages = [user(ImageInput(GRADIENT), QUESTION)]
    first, _ = ask(vision, messages, session="reuse")
    assert vision.projector.encodes == before + 1
    slot = vision.kv.slot_of("reuse")
    assert sentinel_runs(slot.tokens) == [vision_pair.image_tokens]
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Say more."}]
    second, _ = ask(vision, messages, session="reuse")
    assert vision.projector.encodes == before + 1  # not encoded again
    start = slot.tokens.index(next(t for t in slot.tokens if t < 0))
    assert second.metrics.cached_tokens >= start + vision_pair.image_tokens  # the cache covers the image
    assert second.metrics.cached_tokens >= first.metrics.prompt_tokens
    assert vision.kv_problems() == []


def test_a_different_image_of_the_same_size_never_matches_a_cached_one(vision):
    first, _ = ask(vision, [user(ImageInput(GRADIENT), QUESTION)])
    prompt = vision.prompt_tokens(ChatRequest(messages=[user(ImageInput(CHECKS), QUESTION)]))
    start = next(i for i, t in enumerate(prompt) if t < 0)
    before = vision.projector.encodes
    other, _ = ask(vision, [user(ImageInput(CHECKS), QUESTION)])
    assert other.metrics.cached_tokens <= start  # nothing of the other picture's cells is reused
    assert vision.projector.encodes == before + 1
    assert vision.kv_problems() == []


def test_images_sit_where_their_parts_are_and_two_are_encoded_in_order(vision, vision_pair):
    before = vision.projector.encodes
    done, _ = ask(vision, [user("Compare", ImageInput(GRADIENT), "with", ImageInput(CHECKS), "please.")])
    assert done.metrics.prompt_tokens >= 2 * vision_pair.image_tokens
    assert vision.projector.encodes == before + 2
    tokens = vision.prompt_tokens(ChatRequest(messages=[user("Compare", ImageInput(GRADIENT), "with", ImageInput(CHECKS), "please.")]))
    assert sentinel_runs(tokens) == [vision_pair.image_tokens, vision_pair.image_tokens]
    assert vision.kv_problems() == []


def test_the_encode_runs_on_the_encoder_thread_while_another_answer_streams(vision, monkeypatch):
    threads: list[str] = []
    encode = Projector.encode

    def recording(self, chunk):
        threads.append(threading.current_thread().name)
        return encode(self, chunk)

    monkeypatch.setattr(Projector, "encode", recording)
    long = vision.submit(ChatRequest(messages=[{"role": "user", "content": "Count from one to forty."}], sampling=GREEDY, max_tokens=48))
    done, _ = ask(vision, [user(ImageInput(png(40, 40, lambda x, y: (x, 255 - y, 7))), QUESTION)])
    assert long.result(120).error is None
    assert threads == ["edgechat-encode_0"]
    assert vision.kv_problems() == []


def test_an_image_leaves_the_context_with_its_message(vision_pair, models_root):
    config = vision_config(vision_pair, 256, paths=models_root)
    with Engine(config) as engine:
        messages = [{"role": "system", "content": "You are brief."}, user(ImageInput(GRADIENT), QUESTION)]
        evicted = []
        for turn in range(12):
            done, events = ask(engine, messages, session="long", n=16)
            evicted += [e for e in events if isinstance(e, Evicted)]
            slot = engine.kv.slot_of("long")
            # the image is in the cache whole, or not at all
            assert sentinel_runs(slot.tokens) in ([vision_pair.image_tokens], [])
            assert engine.kv_problems() == []
            if evicted and not sentinel_runs(slot.tokens):
                break
            messages += [{"role": "assistant", "content": done.text},
                         {"role": "user", "content": f"Tell me a long story about the number {turn}, in detail."}]
        assert evicted, "the conversation outgrew the context without evicting"
        assert sentinel_runs(engine.kv.slot_of("long").tokens) == []
        assert engine.prepare(ChatRequest(messages=messages, session="long")).media == {}


def test_a_recompute_after_truncation_encodes_the_image_again(vision_pair, models_root):
    # the truncate policy recomputes what follows a cut: a later message's image is re-encoded
    config = vision_config(vision_pair, 192, paths=models_root)
    with Engine(config) as engine:
        messages = [{"role": "user", "content": "Hello there, how are you today?"},
                    {"role": "assistant", "content": "I am fine, thank you."},
                    user(ImageInput(GRADIENT), QUESTION)]
        done, events = ask(engine, messages, session="cut", n=150, context_policy=ContextPolicy.TRUNCATE, ignore_eos=True)
        assert any(isinstance(e, Evicted) for e in events)
        assert engine.projector.encodes >= 2
        assert sentinel_runs(engine.kv.slot_of("cut").tokens) in ([vision_pair.image_tokens], [])
        assert engine.kv_problems() == []


def test_a_snapshot_restores_the_image_cells(vision_pair, models_root):
    config = vision_config(vision_pair, 1024, paths=models_root)
    messages = [user(ImageInput(GRADIENT), QUESTION)]
    with Engine(config) as engine:
        first, _ = ask(engine, messages, session="snap")
        engine.release_session("snap")
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the colours?"}]
    with Engine(config) as engine:  # a new engine: the cells come from the snapshot on disk
        second, _ = ask(engine, messages, session="snap")
        assert engine.projector.encodes == 0
        assert second.metrics.cached_tokens >= first.metrics.prompt_tokens
        assert sentinel_runs(engine.kv.slot_of("snap").tokens) == [vision_pair.image_tokens]
        assert engine.kv_problems() == []


def test_the_prompt_cache_keeps_an_image_prompt_taken_over_by_another(vision_pair, models_root):
    config = vision_config(vision_pair, 512, paths=models_root, prompt_cache_budget=64 << 20)
    with Engine(config) as engine:
        image_prompt = [{"role": "system", "content": "Look closely."}, user(ImageInput(GRADIENT), QUESTION)]
        first, _ = ask(engine, image_prompt)
        ask(engine, [{"role": "user", "content": "Something else entirely: name three rivers."}])
        again, _ = ask(engine, image_prompt)
        assert again.metrics.prompt_cache_hit
        assert again.metrics.restored_tokens >= first.metrics.prompt_tokens - 1
        assert engine.projector.encodes == 1
        assert again.token_ids == first.token_ids
        assert engine.kv_problems() == []


def test_a_text_only_model_refuses_an_image_in_one_line(smol):
    with pytest.raises(UsageError) as err:
        smol.submit(ChatRequest(messages=[user(ImageInput(GRADIENT), QUESTION)]))
    message = str(err.value)
    assert "\n" not in message and "edgechat pull gemma3-4b-it" in message and "--mmproj" in message
    assert smol.modalities == ()


def test_bad_pictures_and_markers_are_one_line_errors(vision):
    for content, words in (
        ([ImageInput(b"not a picture"), QUESTION], "PNG or JPEG"),
        ([ImageInput(GRADIENT), f"{vision.projector.marker} {QUESTION}"], "marker"),
        ([ImageInput(GRADIENT), 42], "text or images"),
    ):
        with pytest.raises(UsageError) as err:
            vision.submit(ChatRequest(messages=[{"role": "user", "content": content}]))
        assert words in str(err.value) and "\n" not in str(err.value)


def test_gemma3_images_decode_non_causal_and_are_reused(gemma3_path, models_root, tmp_path):
    mmproj = write_tiny_mmproj(tmp_path / "gemma3-mmproj.gguf", text_embedding_width(gemma3_path), projector="gemma3")
    config = EngineConfig(model=str(gemma3_path), paths=models_root, n_ctx=1024, mmproj=str(mmproj))
    with Engine(config) as engine:
        text, _ = ask(engine, [{"role": "user", "content": QUESTION}])
        messages = [user(ImageInput(GRADIENT), QUESTION)]
        first, _ = ask(engine, messages, session="g")
        assert first.token_ids != text.token_ids
        slot = engine.kv.slot_of("g")
        assert sentinel_runs(slot.tokens) == [N_IMAGE_TOKENS]
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Again."}]
        second, _ = ask(engine, messages, session="g")
        assert engine.projector.encodes == 1
        assert second.metrics.cached_tokens >= first.metrics.prompt_tokens
        assert engine.kv_problems() == []
