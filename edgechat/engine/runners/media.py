"""Images (and sounds) in a prompt: a model's projector (an mmproj GGUF, through llama.cpp's
libmtmd in engine/runners/mtmd.py), the pictures it reads, and a prompt cut into text and media chunks.

A media chunk is a run of embeddings, not token ids: the projector encodes it (`Projector.encode`,
which needs no text-model context), then the embeddings are decoded at the sequence's next
positions (`Projector.decode`), where text goes through the runner's batch. Each chunk carries the sha256 of the bytes it came from, so a cache can tell the
same picture sent again from a different one of the same size.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgechat.engine.runners.llama import LlamaBackend
from edgechat.engine.runners.mtmd import MediaChunk, MediaContext
from edgechat.errors import UsageError

__all__ = ["Image", "MediaChunk", "Projector", "no_vision", "sentinels"]

#: the catalog's vision model, named where a text-only model is sent an image
VISION_MODEL = "gemma3-4b-it"


def no_vision(model: str) -> str:
    """The one line a model without a vision projector answers an image with."""
    return (f"{model} reads text only; for images pull a vision model (edgechat pull {VISION_MODEL}) "
            f"or give this model's projector with --mmproj FILE")


def sentinels(chunk: MediaChunk) -> list[int]:
    """The entries that stand for a media chunk's cells in a token mirror: one per cell, each a
    negative int32 (never a token id; snapshots and the prompt cache pack mirrors as int32) drawn
    from the image's hash and the cell's index. The same picture gives the same run; a different
    one matches only if every one of its entries collides (31 bits each)."""
    return [
        -1 - (int.from_bytes(hashlib.sha256(f"{chunk.id}:{i}".encode()).digest()[:4], "little") & 0x7FFFFFFE)
        for i in range(chunk.n_tokens)
    ]


@dataclass(frozen=True, eq=False)
class Image:
    """A decoded picture, ready for `Projector.chunks`."""

    #: sha256 of the bytes it was read from (hex)
    hash: str
    width: int
    height: int
    _bitmap: object = field(repr=False)


class Projector:
    """A model's projector on a LlamaBackend (its `model`); close it before the runner.
    Pictures are read and cut into chunks on the submitting threads (one at a time), encoded
    on the engine's encoder thread, decoded on the engine thread: libmtmd's preprocessing and
    its encoder use separate parts of its context, and decoding uses the text model's."""

    def __init__(self, runner: LlamaBackend, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise UsageError(f"no projector file at {self.path}; give the model's mmproj GGUF")
        self._media = MediaContext(runner, self.path)
        #: image encodes run so far (each eval of a media chunk is one): what prefix reuse saves
        self.encodes = 0
        self._prep_lock = threading.Lock()
        self._encode_lock = threading.Lock()

    @property
    def vision(self) -> bool:
        return self._media.vision

    @property
    def audio(self) -> bool:
        return self._media.audio

    @property
    def mrope(self) -> bool:
        """Its images take positions in several dimensions (M-RoPE), fewer than their cells."""
        return self._media.mrope

    @property
    def modalities(self) -> tuple[str, ...]:
        """What the projector reads, as doctor and the model list say it: ("vision",), ..."""
        return tuple(word for word, has in (("vision", self.vision), ("audio", self.audio)) if has)

    @property
    def memory_bytes(self) -> int:
        """What the planner counts for it (planner.projector_bytes)."""
        from edgechat.models.planner import projector_bytes

        return projector_bytes(self.path)

    @property
    def marker(self) -> str:
        """What stands for one image in a prompt's text."""
        return self._media.marker

    def image(self, data: bytes, digest: str | None = None) -> Image:
        """Decode a PNG or JPEG (`digest`: the bytes' sha256 hex, when the caller has it); a
        one-line UsageError for bytes that are neither."""
        if not self.vision:
            raise UsageError(f"the projector {self.path.name} reads no images")
        digest = digest or hashlib.sha256(data).hexdigest()
        with self._prep_lock:
            bitmap = self._media.bitmap(data, digest)
        if not bitmap:
            raise UsageError("cannot read the image: give a PNG or JPEG file")
        width, height, is_audio = self._media.bitmap_info(bitmap)
        if is_audio:
            self._media.free_bitmap(bitmap)
            raise UsageError("that file is a sound, not an image: give a PNG or JPEG file")
        image = Image(digest, width, height, bitmap)
        weakref.finalize(image, self._media.free_bitmap, bitmap)
        return image

    def chunks(self, prompt: str, images: Sequence[Image], add_special: bool = True) -> list[list[int] | MediaChunk]:
        """`prompt` (with one `marker` per image, in order) as text chunks (token ids) and media
        chunks (n_tokens, n_pos, id: the image's hash); `add_special` adds the BOS the model
        wants (a whole prompt's), not for a piece of one."""
        n_markers = prompt.count(self.marker)
        if n_markers != len(images):
            raise UsageError(f"the prompt has {n_markers} image markers for {len(images)} images")
        try:
            with self._prep_lock:
                return self._media.tokenize(prompt, [image._bitmap for image in images], add_special)
        except ValueError as error:
            raise UsageError(str(error)) from None

    def encode(self, chunk: MediaChunk) -> np.ndarray:
        """The chunk's embeddings (n_tokens rows of the text model's input width): the projector's
        work, the costly part on a CPU. It does not touch the text model's context, so it may run
        off the engine thread while other sequences decode; one encode at a time."""
        with self._encode_lock:
            embeddings = self._media.encode(chunk)
            self.encodes += 1
        return embeddings

    def decode(self, chunk: MediaChunk, embeddings: np.ndarray, seq: int, pos: int) -> int:
        """Put encoded embeddings in sequence `seq` at positions from `pos` (engine thread);
        returns the position after them (`pos + chunk.n_pos`)."""
        return self._media.decode(chunk, embeddings, pos, seq)

    def eval(self, chunk: MediaChunk, seq: int, pos: int) -> int:
        """Encode and decode in one go."""
        return self.decode(chunk, self.encode(chunk), seq, pos)

    def close(self) -> None:
        self._media.close()
