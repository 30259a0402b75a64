"""A scripted ModelRunner with no model: the scheduler's plans and updates tested alone.

Its vocabulary is the letters a..o (ids 1..15) and an end-of-text token (0). The next token
after a sequence is `script(tokens)`, given as one-hot logits; its cells are a dict of position
-> token per sequence, so the KV manager's mirrors are checked against what the runner really
holds, and every run's rows are recorded for the tests to read.
"""

from __future__ import annotations

import pickle

import numpy as np

from edgechat.engine.runners.runner import ListBatch

N_VOCAB = 16
EOS = 0


def text_of(tokens: list[int]) -> str:
    return "".join(chr(ord("a") + t - 1) for t in tokens if t != EOS)


def tokens_of(text: str) -> list[int]:
    return [ord(c) - ord("a") + 1 for c in text]


def cycle(tokens: list[int]) -> int:
    """The default script: the letter after the last one, round a..o (drafts always hit)."""
    return tokens[-1] % (N_VOCAB - 1) + 1


class FakeRunner:
    n_vocab = N_VOCAB
    vocab = None
    bos, eos, add_bos = -1, EOS, False
    can_shift = True
    shares_cells = False
    swa_window = small_swa = 0

    def __init__(self, n_seq_max: int, n_batch: int = 2048, script=cycle):
        self.n_seq_max, self.n_batch, self.script = n_seq_max, n_batch, script
        self.cells: list[dict[int, int]] = [{} for _ in range(n_seq_max)]
        #: per run: [(seq, rows of that sequence), ...] in the order they came
        self.runs: list[list[tuple[int, int]]] = []
        self._logits: dict[int, np.ndarray] = {}

    # --- compute
    def new_batch(self, capacity: int) -> ListBatch:
        return ListBatch(capacity)

    def decode(self, batch: ListBatch) -> None:
        self._logits = {}
        shape: list[tuple[int, int]] = []
        for row, (tok, pos, seq, want) in enumerate(zip(batch.tokens, batch.pos, batch.seq, batch.logits, strict=True)):
            cells = self.cells[seq]
            assert pos not in cells, f"seq {seq}: position {pos} written twice"
            cells[pos] = tok
            if want:
                held = [cells[p] for p in sorted(cells) if p <= pos]
                logits = np.zeros(N_VOCAB, np.float32)
                logits[self.script(held)] = 10.0
                self._logits[row] = logits
            if shape and shape[-1][0] == seq:
                shape[-1] = (seq, shape[-1][1] + 1)
            else:
                shape.append((seq, 1))
        self.runs.append(shape)

    def logits(self, row: int) -> np.ndarray:
        return self._logits[row]

    def argmax(self, row: int) -> int:
        return int(self._logits[row].argmax())

    def sample(self, sampler, row: int) -> int:
        return sampler.choose(self._logits[row])

    def top_logits(self, row: int, n: int) -> list[tuple[int, float]]:
        logits = self._logits[row]
        return [(int(t), float(logits[t])) for t in np.argsort(-logits)[:n]]

    # --- memory
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        lo, hi = max(p0, 0), (p1 if p1 >= 0 else 1 << 30)
        self.cells[seq] = {p: t for p, t in self.cells[seq].items() if not lo <= p < hi}
        return True

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        hi = p1 if p1 >= 0 else 1 << 30
        self.cells[seq] = {(p + delta if p0 <= p < hi else p): t for p, t in self.cells[seq].items()}

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        hi = p1 if p1 >= 0 else 1 << 30
        self.cells[dst].update({p: t for p, t in self.cells[src].items() if max(p0, 0) <= p < hi})

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        cells = self.cells[seq]
        return (min(cells), max(cells)) if cells else (-1, -1)

    def seq_cell_positions(self, seq: int) -> list[int]:
        return sorted(self.cells[seq])

    def state_seq_get(self, seq: int) -> bytearray:
        return bytearray(pickle.dumps(self.cells[seq]))

    def state_seq_set(self, seq: int, data) -> bool:
        self.cells[seq] = pickle.loads(bytes(data))
        return True

    # --- text
    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        return tokens_of(text)

    def piece(self, token: int) -> bytes:
        return text_of([token]).encode()

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return text_of(tokens)

    def token_text(self, token: int) -> str:
        return text_of([token])

    def meta(self, key: str) -> str | None:
        return None

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def is_control(self, token: int) -> bool:
        return token == EOS

    def close(self) -> None:
        pass
