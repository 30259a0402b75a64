"""What the engine asks of a model: the `ModelRunner` protocol every backend implements.

The scheduler plans a step as a `TokenBatch` (token, position, sequence, whether its logits are
wanted, per row), a runner runs it and answers for the rows that wanted logits until its next
run; the KV manager is the only caller of the memory operations. Two runners implement it:
`runners/llama.py`'s `LlamaBackend` (llama.cpp, its batch the native `llama_batch`) and
`runners/onnxrt.py`'s `OnnxRunner` (onnxruntime, a `ListBatch`); both read text through
`runners/vocab.py`'s `Vocabulary`. What a runner's memory cannot do it
says in its capability flags, and the KV manager falls back (recomputing instead of shifting,
copying instead of sharing).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenBatch(Protocol):
    """One step's input rows, written by the scheduler, read by the runner that made it."""

    capacity: int

    @property
    def n(self) -> int:
        """Rows written."""
        ...

    def clear(self) -> None: ...

    def add(self, token: int, pos: int, seq_id: int, want_logits: bool) -> int:
        """Append a row; returns its index (what `logits` and `sample` take after the run)."""
        ...

    @property
    def free(self) -> int: ...

    def close(self) -> None: ...


class ListBatch:
    """A TokenBatch in Python lists, for runners that read rows themselves (onnxruntime, tests)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tokens: list[int] = []
        self.pos: list[int] = []
        self.seq: list[int] = []
        self.logits: list[bool] = []

    @property
    def n(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens.clear()
        self.pos.clear()
        self.seq.clear()
        self.logits.clear()

    def add(self, token: int, pos: int, seq_id: int, want_logits: bool) -> int:
        if len(self.tokens) >= self.capacity:
            raise IndexError("the batch is full")
        self.tokens.append(token)
        self.pos.append(pos)
        self.seq.append(seq_id)
        self.logits.append(want_logits)
        return len(self.tokens) - 1

    @property
    def free(self) -> int:
        return self.capacity - len(self.tokens)

    def close(self) -> None:
        self.clear()


class ModelRunner(Protocol):
    """A loaded model with a KV cache of `n_seq_max` sequences."""

    #: rows one run takes at most
    n_batch: int
    n_seq_max: int
    n_vocab: int
    #: llama.cpp's vocabulary handle (samplers and grammars are llama.cpp's for every backend)
    vocab: object
    bos: int
    eos: int
    add_bos: bool
    #: seq_add can move cells to new positions (rotated keys re-rotated)
    can_shift: bool
    #: seq_cp shares cells between sequences (a unified cache) rather than copying them
    shares_cells: bool
    #: the sliding layers' window (0: none), and the window where the cache keeps only it
    swa_window: int
    small_swa: int

    # --- compute
    def new_batch(self, capacity: int) -> TokenBatch: ...

    def decode(self, batch: TokenBatch) -> None: ...

    def logits(self, row: int) -> np.ndarray:
        """The logits of a row of the last run, valid until the next run."""
        ...

    def argmax(self, row: int) -> int: ...

    def sample(self, sampler, row: int) -> int:
        """A token from a row's logits through a `sampling.SamplerChain`."""
        ...

    def top_logits(self, row: int, n: int) -> list[tuple[int, float]]: ...

    # --- memory (the KV manager's alone)
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool: ...

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None: ...

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...

    def seq_pos_range(self, seq: int) -> tuple[int, int]: ...

    def seq_cell_positions(self, seq: int) -> list[int]: ...

    def state_seq_get(self, seq: int) -> bytearray: ...

    def state_seq_set(self, seq: int, data: bytes | bytearray) -> bool: ...

    # --- text (llama.cpp's tokenizer for every backend)
    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def detokenize(self, tokens: list[int], special: bool = False) -> str: ...

    def token_text(self, token: int) -> str: ...

    def meta(self, key: str) -> str | None: ...

    def is_eog(self, token: int) -> bool: ...

    def is_control(self, token: int) -> bool: ...

    def close(self) -> None: ...
