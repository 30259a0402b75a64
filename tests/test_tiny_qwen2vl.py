"""The tiny M-RoPE pair's own tests (tests/tiny_qwen2vl.py), and what llama.cpp does with an
M-RoPE image's positions, as docs/mrope-notes.md records them (the KV manager's position map is
built on them; tests/test_vision_mrope.py runs the pair through the engine). Driven at the low
level (LlamaBackend, Projector), as tests/test_vision.py drives the LLaVA-layout projector.

Random weights: these tests prove the files load, the image is cut and decoded, and where its
cells land; never anything about what a picture shows.
"""

from __future__ import annotations

import struct

import llama_cpp
import pytest
from conftest import GREEDY
from test_vision import greedy, prefill
from tiny_mmproj import GRADIENT, png
from tiny_qwen2vl import tokens_per_side, write_tiny_qwen2vl, write_tiny_qwen2vl_mmproj

from edgechat.engine import ChatRequest, Engine, EngineConfig, ImageInput
from edgechat.engine.runners.llama import DecodeError, LlamaBackend
from edgechat.engine.runners.media import Projector
from edgechat.engine.runners.vocab import Vocabulary
from edgechat.errors import UsageError
from edgechat.models.planner import default_threads

#: 48x16 pixels: 6x2 image tokens, which take max(6, 2) positions
WIDE = png(48, 16, lambda x, y: (x * 5, y * 15, 64))
#: a KV cell as llama.cpp's sequence state lists it: (position, x, y, token; -1 for an embedding)
Cell = tuple[int, int, int, int]


@pytest.fixture(scope="module")
def model(smollm2_path, tmp_path_factory):
    return write_tiny_qwen2vl(tmp_path_factory.mktemp("qwen2vl") / "tiny-qwen2vl.gguf", smollm2_path)


@pytest.fixture(scope="module")
def backend(model):
    be = LlamaBackend(model, n_ctx_total=512, n_seq_max=2, n_threads=default_threads())
    yield be
    be.close()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    return write_tiny_qwen2vl_mmproj(tmp_path_factory.mktemp("qwen2vl-mmproj") / "mmproj.gguf")


@pytest.fixture(scope="module")
def projector(backend, mmproj):
    proj = Projector(backend, mmproj)
    yield proj
    proj.close()


def cells(backend: LlamaBackend, seq: int) -> list[Cell]:
    """The sequence's cells in cache order. An M-RoPE cache writes each cell's 2-D extension
    (llama_kv_cell_ext: x, y, token) between its sequence count and its sequence ids
    (llama_kv_cache::state_write_meta); LlamaBackend.seq_cell_positions reads the positions."""
    data = backend.state_seq_get(seq)
    _magic, seq_read, n_stream, n_cells = struct.unpack_from("<IiII", data, 0)
    assert (seq_read, n_stream) == (seq, 1)
    off, out = 16, []
    for _ in range(n_cells):
        pos, n_ids, x, y, token = struct.unpack_from("<iIiii", data, off)
        assert struct.unpack_from(f"<{n_ids}i", data, off + 20) == (seq,)
        out.append((pos, x, y, token))
        off += 20 + 4 * n_ids
    return out


def prompt(marker: str, n_images: int = 1) -> str:
    return f"<|im_start|>user\n{marker * n_images}\nWhat is in this picture?<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_qwen2vl_text_model_loads_with_smollm2s_tokenizer_and_decodes(backend, smollm2_path):
    assert backend.meta("general.architecture") == "qwen2vl"
    # what makes libmtmd give images M-RoPE positions (mtmd_context's pos_type)
    assert llama_cpp.llama_model_rope_type(backend.model) == llama_cpp.LLAMA_ROPE_TYPE_MROPE
    smol = Vocabulary(smollm2_path)
    text = prompt("a picture")
    assert backend.n_vocab == smol.n_vocab and backend.tokenize(text) == smol.tokenize(text)
    # an M-RoPE cache cannot shift (llama_kv_cache::get_can_shift); seq_add would abort
    assert not backend.can_shift
    backend.seq_rm(0)
    pos, index = prefill(backend, None, [backend.tokenize(text, add_bos=True)], 0)
    answer = greedy(backend, index, pos, 0)
    assert all(0 <= t < backend.n_vocab for t in answer)
    # text alone: one cell per position, the 1-D position copied into every section
    assert cells(backend, 0) == [(p, p, p, t) for p, t in enumerate(backend.tokenize(text, add_bos=True) + answer)]


def test_tiny_qwen2vl_projector_loads_as_mrope(projector):
    assert projector.vision and projector.modalities == ("vision",)
    assert projector.mrope


def test_tiny_qwen2vl_image_takes_fewer_positions_than_cells(projector):
    for data, (nx, ny) in ((GRADIENT, (5, 5)), (WIDE, (6, 2))):
        image = projector.image(data)
        assert (tokens_per_side(image.width), tokens_per_side(image.height)) == (nx, ny)
        chunks = projector.chunks(prompt(projector.marker), [image])
        media = [c for c in chunks if not isinstance(c, list)]
        assert len(media) == 1 and not media[0].non_causal
        assert (media[0].n_tokens, media[0].n_pos) == (nx * ny, max(nx, ny))


def test_tiny_qwen2vl_image_cells_share_one_position_and_text_resumes_after_n_pos(backend, projector):
    images = [projector.image(GRADIENT), projector.image(WIDE)]
    chunks = projector.chunks(prompt(projector.marker, 2), images)
    widths = iter(tokens_per_side(image.width) for image in images)
    kinds = ["text" if isinstance(c, list) else "image" for c in chunks]
    assert kinds == ["text", "image", "text", "image", "text"]  # <|vision_start|> ... <|vision_end|> around each
    backend.seq_rm(0)
    pos, index = prefill(backend, projector, chunks, 0)
    answer = greedy(backend, index, pos, 0)

    expected: list[Cell] = []
    p = 0
    for chunk in chunks:
        if isinstance(chunk, list):
            expected += [(p + j, p + j, p + j, t) for j, t in enumerate(chunk)]
            p += len(chunk)
        else:
            nx = next(widths)
            # every cell at the image's first position; x, y: that position plus column, row
            expected += [(p, p + i % nx, p + i // nx, -1) for i in range(chunk.n_tokens)]
            p += chunk.n_pos
    got = cells(backend, 0)
    assert got[: len(expected)] == expected
    assert got[len(expected):] == [(p + j, p + j, p + j, t) for j, t in enumerate(answer)]
    n_cells = sum(len(c) if isinstance(c, list) else c.n_tokens for c in chunks)
    assert pos == p and len(expected) == n_cells and p < n_cells
    # positions after each image's first are held by no cell: llama.cpp's range hides the gaps
    held = {c[0] for c in got}
    assert backend.seq_pos_range(0) == (0, max(held)) and len(held) < max(held) + 1


def test_tiny_qwen2vl_what_llama_cpp_allows_around_an_image(backend, projector):
    chunks = projector.chunks(prompt(projector.marker), [projector.image(GRADIENT)])
    start = len(chunks[0])  # the image's position
    media = chunks[1]
    backend.seq_rm(0)
    prefill(backend, projector, chunks[:1], 0)
    assert projector.eval(media, 0, start) == start + media.n_pos
    assert backend.seq_pos_range(0) == (0, start)
    batch = backend.new_batch(1)
    try:
        # text must go past the highest position held (M-RoPE: X < Y, jumps allowed), so a
        # token at the image's own position is refused ...
        batch.add(chunks[2][0], start, 0, True)
        with pytest.raises(DecodeError):
            backend.decode(batch)
        # ... and one at the mirror's length (what the KV manager would give it) is taken
        # silently, positions past where mtmd's layout puts it
        n_cells = start + media.n_tokens
        batch.clear()
        batch.add(chunks[2][0], n_cells, 0, True)
        backend.decode(batch)
        assert cells(backend, 0)[-1][0] == n_cells
    finally:
        batch.close()

    # a cut by position inside the image's span keeps the whole image (its cells are all at
    # `start`) and drops what follows; a cut at `start` drops the image whole
    assert backend.seq_rm(0, start + 1, -1)
    assert len(cells(backend, 0)) == start + media.n_tokens
    state = backend.state_seq_get(0)
    assert backend.seq_rm(0, start, -1) and backend.seq_pos_range(0) == (0, start - 1)
    assert len(cells(backend, 0)) == start

    # a saved state brings the 2-D positions back, in this sequence or another
    backend.seq_rm(0)
    assert backend.state_seq_set(0, state)
    restored = cells(backend, 0)
    nx = tokens_per_side(40)  # GRADIENT's side
    assert restored[start:] == [(start, start + i % nx, start + i // nx, -1) for i in range(media.n_tokens)]
    backend.seq_rm(1)
    assert backend.state_seq_set(1, backend.state_seq_get(0))
    assert cells(backend, 1) == restored
    # the engine's own reader of cell positions (KVManager.check) reads this layout
    assert backend.cell_ext
    assert backend.seq_cell_positions(1) == sorted(c[0] for c in restored) == list(range(start)) + [start] * media.n_tokens
    backend.seq_rm(1)


def test_tiny_qwen2vl_the_engine_loads_the_projector_and_chats_with_or_without_it(model, mmproj, models_root):
    image = {"role": "user", "content": [ImageInput(GRADIENT), "What is in this picture?"]}
    with Engine(EngineConfig(model=str(model), paths=models_root, n_ctx=256, mmproj=str(mmproj))) as engine:
        assert engine.modalities == ("vision",)
        events = list(engine.submit(ChatRequest(messages=[image], sampling=GREEDY, max_tokens=4)))
        assert events[-1].error is None and engine.kv_problems() == []
    # text alone needs no position map: each token takes the position of its mirror index
    with Engine(EngineConfig(model=str(model), paths=models_root, n_ctx=256)) as engine:
        assert engine.modalities == ()
        events = list(engine.submit(ChatRequest(messages=[{"role": "user", "content": "hi"}], sampling=GREEDY, max_tokens=4)))
        assert events[-1].error is None and engine.kv_problems() == []
        with pytest.raises(UsageError):
            engine.submit(ChatRequest(messages=[image]))
