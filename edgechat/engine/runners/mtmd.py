"""libmtmd, llama.cpp's multimodal library: a projector on a loaded model, pictures and sounds
decoded, a prompt cut into text and media chunks, a chunk's embeddings into a sequence.
The library itself loads with the first `MediaContext`, so a text-only engine never loads it."""

from __future__ import annotations

import ctypes
import os
import weakref
from pathlib import Path

import llama_cpp as L
import numpy as np

from edgechat.engine.runners.llama import LlamaBackend
from edgechat.engine.runners.llamacpp import DecodeError, clear_log, log_callback, log_text
from edgechat.errors import ModelFormatError


class MediaChunk:
    """One image (or audio) chunk of a tokenized prompt, owned: a copy of mtmd's chunk, freed with
    this object (the chunk list it came from is freed at once)."""

    def __init__(self, M, ctx, native):
        self.native = native
        #: its cells attend to each other both ways (Gemma 3): one ubatch, never cut
        self.non_causal = bool(M.mtmd_decode_use_non_causal(ctx, native))
        self.kind = "audio" if M.mtmd_input_chunk_get_type(native) == M.MTMD_INPUT_CHUNK_TYPE_AUDIO else "image"
        #: embeddings it puts in the sequence (cells), and positions it takes (M-RoPE: fewer)
        self.n_tokens = M.mtmd_input_chunk_get_n_tokens(native)
        self.n_pos = M.mtmd_input_chunk_get_n_pos(native)
        self.id = (M.mtmd_input_chunk_get_id(native) or b"").decode()
        self._finalizer = weakref.finalize(self, M.mtmd_input_chunk_free, native)


class MediaContext:
    """libmtmd on a LlamaBackend's model: a projector (mmproj GGUF) that turns images into the
    text model's embeddings. Imported on first use, so a text-only engine never loads libmtmd.
    Close it before the runner: it reads the runner's model."""

    def __init__(self, runner: LlamaBackend, path: Path):
        import llama_cpp.mtmd_cpp as M

        self._M = M
        self._runner = runner
        # mtmd and clip log to stderr by default; keep their lines for the error below
        M.mtmd_helper_log_set(log_callback, ctypes.c_void_p(0))
        params = M.mtmd_context_params_default()
        params.n_threads = L.llama_n_threads(runner.ctx)
        params.print_timings = False
        clear_log()
        ctx = M.mtmd_init_from_file(os.fsencode(path), runner.model, params)
        if not ctx:
            raise ModelFormatError(f"cannot load the projector {Path(path).name}: {_mtmd_failure_reason()}")
        self.ctx = ctx
        self.vision = bool(M.mtmd_support_vision(ctx))
        self.audio = bool(M.mtmd_support_audio(ctx))
        #: positions in several dimensions (Qwen2-VL's M-RoPE): an image takes fewer positions
        #: than cells
        self.mrope = bool(M.mtmd_decode_use_mrope(ctx))
        #: the text that stands for one picture or sound in a prompt
        self.marker = M.mtmd_default_marker().decode()

    def bitmap(self, data: bytes, ident: str):
        """A decoded image (PNG, JPEG, what stb_image reads) or sound, its id set to `ident` (its
        chunk will carry it); None if mtmd cannot read it. Free it with `free_bitmap`."""
        M = self._M
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
        if bitmap:
            M.mtmd_bitmap_set_id(bitmap, ident.encode())
        return bitmap

    def bitmap_info(self, bitmap) -> tuple[int, int, bool]:
        """Width, height (pixels; samples and 1 for a sound) and whether it is a sound."""
        M = self._M
        return M.mtmd_bitmap_get_nx(bitmap), M.mtmd_bitmap_get_ny(bitmap), bool(M.mtmd_bitmap_is_audio(bitmap))

    def free_bitmap(self, bitmap) -> None:
        self._M.mtmd_bitmap_free(bitmap)

    def tokenize(self, text: str, bitmaps: list, add_special: bool = True) -> list[list[int] | MediaChunk]:
        """The prompt as chunks: token ids for text, a MediaChunk where a marker stood (markers
        and bitmaps in the same order). Special tokens in the text are parsed; with
        `add_special`, BOS is added as the model asks. Raises ValueError with mtmd's reason."""
        M = self._M
        raw = text.encode()
        inp = M.mtmd_input_text(raw, len(raw), add_special, True)
        arr = (M.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
        chunks = M.mtmd_input_chunks_init()
        try:
            rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc == 1:
                raise ValueError("the prompt's media markers and its images differ in number")
            if rc != 0:
                raise ValueError(f"the image could not be prepared for the projector ({_mtmd_failure_reason()})")
            out: list[list[int] | MediaChunk] = []
            n = ctypes.c_size_t()
            for i in range(M.mtmd_input_chunks_size(chunks)):
                chunk = M.mtmd_input_chunks_get(chunks, i)
                if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    ids = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    out.append(ids[: n.value])
                else:
                    out.append(MediaChunk(M, self.ctx, M.mtmd_input_chunk_copy(chunk)))
            return out
        finally:
            M.mtmd_input_chunks_free(chunks)

    def encode(self, chunk: MediaChunk) -> np.ndarray:
        """The chunk's embeddings, (n_tokens, the text model's input width), float32, copied out
        of mtmd's buffer. Runs the projector only (not the text model's context), so it may run
        on another thread while the engine decodes; one encode at a time per MediaContext."""
        M = self._M
        if M.mtmd_encode_chunk(self.ctx, chunk.native) != 0:
            raise DecodeError(f"mtmd could not encode the {chunk.kind}: {_mtmd_failure_reason()}")
        shape = (chunk.n_tokens, L.llama_model_n_embd_inp(self._runner.model))
        return np.ctypeslib.as_array(M.mtmd_get_output_embd(self.ctx), shape).copy()

    def decode(self, chunk: MediaChunk, embeddings: np.ndarray, pos: int, seq: int) -> int:
        """Decode `encode`'s embeddings into sequence `seq` from position `pos`, in batches of the
        context's size, with the chunk's positions (M-RoPE included) and attention (non-causal
        where the model wants it); returns the position after it. Asks no logits."""
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        new_pos = L.llama_pos(pos)
        rc = self._M.mtmd_helper_decode_image_chunk(
            self.ctx,
            self._runner.ctx,
            chunk.native,
            embeddings.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            pos,
            seq,
            self._runner.n_batch,
            ctypes.byref(new_pos),
            self._M.mtmd_helper_post_decode_callback(),  # a NULL one: nothing to do after each batch
            None,
        )
        if rc != 0:
            raise DecodeError(f"llama.cpp could not decode the {chunk.kind}'s embeddings ({rc}): {_mtmd_failure_reason()}")
        return new_pos.value

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._M.mtmd_free(self.ctx)
            self.ctx = None


def _mtmd_failure_reason() -> str:
    for line in reversed(log_text().splitlines()):
        if "error" in line.lower() or "mismatch" in line.lower() or "failed" in line.lower():
            return line.strip()
    return "libmtmd could not read it; the file may be damaged or made for another model"
