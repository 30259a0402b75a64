"""Images in through llama.cpp's libmtmd (engine/runners/media.py), on the embedded SmolLM2 paired with a
tiny projector the tests write (tests/tiny_mmproj.py: LLaVA's mlp layout, random weights).

What random weights can prove: the projector file is in the layout llama.cpp's clip loader reads,
libmtmd accepts it for SmolLM2's embedding width (and refuses another width), pictures are
decoded, resized and cut into the chunk the projector's geometry says, the image's embeddings land
in the sequence's cells at the positions mtmd gives, they reach the text model (the greedy answer
changes against the same prompt without them), the whole path is deterministic, and each chunk
carries the hash of its bytes, so a cache can tell one picture from another of the same size.
What they cannot prove: anything about what a picture shows, or that an answer is about it; no
test here reads meaning into the tokens, only whether they are equal or differ.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
from tiny_mmproj import CHECKS, GRADIENT, N_IMAGE_TOKENS, text_embedding_width, write_tiny_mmproj

from edgechat.engine.runners.llama import LlamaBackend
from edgechat.engine.runners.media import Projector, sentinels
from edgechat.errors import ModelFormatError, UsageError
from edgechat.models.planner import default_threads

ANSWER_TOKENS = 8


@pytest.fixture(scope="module")
def mmproj(smollm2_path, tmp_path_factory):
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf", text_embedding_width(smollm2_path))


@pytest.fixture(scope="module")
def backend(smollm2_path):
    be = LlamaBackend(smollm2_path, n_ctx_total=1024, n_seq_max=2, n_threads=default_threads())
    yield be
    be.close()


@pytest.fixture(scope="module")
def projector(backend, mmproj):
    proj = Projector(backend, mmproj)
    yield proj
    proj.close()


def prompt(marker: str) -> str:
    return f"<|im_start|>user\n{marker}\nWhat is in this picture?<|im_end|>\n<|im_start|>assistant\n"


def prefill(backend: LlamaBackend, projector: Projector, chunks: list, seq: int, pos: int = 0) -> tuple[int, int]:
    """Put the chunks in sequence `seq` from position `pos` (text through the backend's batch,
    images through the projector); returns the next position and the batch index of the last
    row's logits."""
    assert isinstance(chunks[-1], list), "the prompt ends in text, whose last row gives the logits"
    batch = backend.new_batch(backend.n_batch)
    for i, chunk in enumerate(chunks):
        if isinstance(chunk, list):
            batch.clear()
            for j, token in enumerate(chunk):
                index = batch.add(token, pos + j, seq, i == len(chunks) - 1 and j == len(chunk) - 1)
            backend.decode(batch)
            pos += len(chunk)
        else:
            pos = projector.eval(chunk, seq, pos)
    batch.close()
    assert backend.seq_pos_range(seq) == (0, pos - 1), "every chunk's cells are where mtmd said"
    return pos, index


def greedy(backend: LlamaBackend, index: int, pos: int, seq: int) -> list[int]:
    """ANSWER_TOKENS greedy tokens after the logits at `index`, the first going in at `pos`."""
    batch = backend.new_batch(1)
    tokens = []
    for _ in range(ANSWER_TOKENS):
        tokens.append(backend.argmax(index))
        batch.clear()
        index = batch.add(tokens[-1], pos, seq, True)
        backend.decode(batch)
        pos += 1
    batch.close()
    return tokens


def answer(backend: LlamaBackend, projector: Projector, chunks: list, seq: int = 0) -> tuple[list[int], np.ndarray]:
    """The chunks prefilled into an emptied sequence, then the greedy answer; returns it and the
    logits that chose its first token."""
    backend.seq_rm(seq)
    pos, index = prefill(backend, projector, chunks, seq)
    first_logits = backend.logits(index).copy()
    return greedy(backend, index, pos, seq), first_logits


def test_projector_loads_and_reports_vision(projector, mmproj):
    assert projector.vision and not projector.audio
    assert projector.modalities == ("vision",)
    assert projector.memory_bytes == mmproj.stat().st_size
    assert projector.marker


def test_a_projector_for_another_width_or_a_damaged_one_is_refused_in_one_line(backend, tmp_path):
    wrong = write_tiny_mmproj(tmp_path / "wide.gguf", 640)
    with pytest.raises(ModelFormatError) as refused:
        Projector(backend, wrong)
    message = str(refused.value)
    assert "\n" not in message and "wide.gguf" in message and "640" in message
    (tmp_path / "junk.gguf").write_bytes(wrong.read_bytes()[:100])
    with pytest.raises(ModelFormatError, match="cannot load the projector junk.gguf: [^\n]+$"):
        Projector(backend, tmp_path / "junk.gguf")
    with pytest.raises(UsageError, match="no projector file at"):
        Projector(backend, tmp_path / "missing.gguf")


def test_image_chunk_geometry_and_hash(projector):
    image = projector.image(GRADIENT)
    assert (image.width, image.height) == (40, 40)
    chunks = projector.chunks(prompt(projector.marker), [image])
    media = [c for c in chunks if not isinstance(c, list)]
    assert len(media) == 1 and len(chunks) == 3
    # resized to the projector's 32x32, cut into 8x8 patches: 16 embeddings at 16 positions
    assert (media[0].kind, media[0].n_tokens, media[0].n_pos) == ("image", N_IMAGE_TOKENS, N_IMAGE_TOKENS)
    # LLaVA's layout: one position per cell, causal attention (Gemma 3's images are non-causal)
    assert not projector.mrope and not media[0].non_causal
    assert media[0].id == image.hash == hashlib.sha256(GRADIENT).hexdigest()


def test_an_image_changes_the_greedy_answer_and_the_same_image_repeats_it(backend, projector):
    chunks = projector.chunks(prompt(projector.marker), [projector.image(GRADIENT)])
    # the same text tokens with the picture left out: only the image differs
    without, _ = answer(backend, projector, [c for c in chunks if isinstance(c, list)])
    before = projector.encodes
    first, first_logits = answer(backend, projector, chunks)
    second, second_logits = answer(backend, projector, projector.chunks(prompt(projector.marker), [projector.image(GRADIENT)]))
    assert first != without
    assert first == second and np.array_equal(first_logits, second_logits)
    assert projector.encodes == before + 2  # no reuse yet: each prefill encodes its picture


def test_a_different_image_of_the_same_size_has_another_hash_and_other_embeddings(backend, projector):
    gradient, checks = projector.image(GRADIENT), projector.image(CHECKS)
    assert (gradient.width, gradient.height) == (checks.width, checks.height)
    assert gradient.hash != checks.hash
    chunks = [projector.chunks(prompt(projector.marker), [img]) for img in (gradient, checks)]
    assert [c[1].id for c in chunks] == [gradient.hash, checks.hash]
    # the pixels reach the text model: the next-token logits differ (random weights may still
    # pick the same greedy tokens for both, so those are not compared)
    (_, gradient_logits), (_, checks_logits) = (answer(backend, projector, c) for c in chunks)
    assert not np.allclose(gradient_logits, checks_logits)
    # their cells' entries in a token mirror: one per cell, never a token id, none shared
    mirrors = [sentinels(c[1]) for c in chunks]
    assert all(len(m) == N_IMAGE_TOKENS and all(-(2**31) <= t < 0 for t in m) for m in mirrors)
    assert not set(mirrors[0]) & set(mirrors[1])
    assert sentinels(projector.chunks(prompt(projector.marker), [projector.image(GRADIENT)])[1]) == mirrors[0]


def test_bad_input_is_one_line(projector):
    with pytest.raises(UsageError, match="PNG or JPEG"):
        projector.image(b"not a picture")
    with pytest.raises(UsageError, match="1 image markers for 0 images"):
        projector.chunks(prompt(projector.marker), [])


def test_image_cells_are_a_prefix_to_share_and_restore_without_a_second_encode(backend, projector):
    """What the KV manager will rely on: an image's cells, once decoded, are cells like a
    prompt's: another sequence sharing them (seq_cp) and a saved and restored sequence state go
    on after them as a cold prefill of the whole prompt does, and neither encodes the image."""
    chunks = projector.chunks(prompt(projector.marker), [projector.image(GRADIENT)])
    follow = backend.tokenize("The picture shows", special=False)
    cold, _ = answer(backend, projector, [*chunks, follow], seq=1)
    backend.seq_rm(0)
    pos, _ = prefill(backend, projector, chunks, 0)
    encodes = projector.encodes

    backend.seq_rm(1)
    backend.seq_cp(0, 1, 0, pos)
    end, index = prefill(backend, projector, [follow], 1, pos)
    assert greedy(backend, index, end, 1) == cold

    backend.seq_rm(1)
    state = backend.state_seq_get(0)
    backend.seq_rm(0)
    assert backend.state_seq_set(0, state)
    end, index = prefill(backend, projector, [follow], 0, pos)
    assert greedy(backend, index, end, 0) == cold
    assert projector.encodes == encodes


def test_an_image_encoded_on_another_thread_while_text_decodes_gives_the_same_answer(backend, projector, smollm2_path):
    """The projector's encode needs no text-model context, so the engine can run it off its
    thread while other sequences decode, and decode the embeddings in a later step."""
    chunks = projector.chunks(prompt(projector.marker), [projector.image(CHECKS)])
    expected, expected_logits = answer(backend, projector, chunks)

    encoded = {}
    worker = threading.Thread(target=lambda: encoded.update(embeddings=projector.encode(chunks[1])))
    backend.seq_rm(1)
    worker.start()
    other, _ = answer(backend, projector, [backend.tokenize("Hello there, how are you today?")], seq=1)
    worker.join()
    embeddings = encoded["embeddings"]
    assert embeddings.shape == (chunks[1].n_tokens, text_embedding_width(smollm2_path))

    backend.seq_rm(0)
    pos, _ = prefill(backend, projector, [chunks[0]], 0)
    pos = projector.decode(chunks[1], embeddings, 0, pos)
    end, index = prefill(backend, projector, [chunks[2]], 0, pos)
    logits = backend.logits(index).copy()
    assert greedy(backend, index, end, 0) == expected and np.array_equal(logits, expected_logits)
    # and once more from the same embeddings, with no encode
    encodes = projector.encodes
    backend.seq_rm(0, len(chunks[0]))
    pos = projector.decode(chunks[1], embeddings, 0, len(chunks[0]))
    end, index = prefill(backend, projector, [chunks[2]], 0, pos)
    assert greedy(backend, index, end, 0) == expected and projector.encodes == encodes
    assert other == answer(backend, projector, [backend.tokenize("Hello there, how are you today?")], seq=1)[0]


def test_gemma3_layout_wraps_the_image_and_decodes_it_non_causal(gemma3_path, tmp_path):
    """Gemma 3's projector type (the catalog's vision model is a Gemma 3) on the embedded Gemma 3
    270M: mtmd puts <start_of_image> and <end_of_image> around the image's 16 cells, decodes them
    with attention both ways, and the picture reaches the model (the greedy tokens of this small
    model may stay as they are; the logits after the prompt differ) deterministically."""
    backend = LlamaBackend(gemma3_path, n_ctx_total=1024, n_seq_max=1, n_threads=default_threads())
    projector = Projector(backend, write_tiny_mmproj(tmp_path / "g3.gguf", text_embedding_width(gemma3_path), "gemma3"))
    try:
        text = f"<start_of_turn>user\n{projector.marker}\nWhat is in this picture?<end_of_turn>\n<start_of_turn>model\n"
        chunks = projector.chunks(text, [projector.image(CHECKS)])
        before, image, after = chunks
        assert (image.n_tokens, image.n_pos, image.non_causal, projector.mrope) == (N_IMAGE_TOKENS, N_IMAGE_TOKENS, True, False)
        assert before[-1] == backend.tokenize("<start_of_image>")[0] and after[0] == backend.tokenize("<end_of_image>")[0]
        first, first_logits = answer(backend, projector, chunks)
        again, again_logits = answer(backend, projector, projector.chunks(text, [projector.image(CHECKS)]))
        _, without_logits = answer(backend, projector, [before + after])
        assert first == again and np.array_equal(first_logits, again_logits)
        assert not np.allclose(first_logits, without_logits)
    finally:
        projector.close()
        backend.close()
