"""The onnxruntime backend for ONNX model folders: `OnnxRunner`, the onnxruntime `ModelRunner`
(engine/runners/runner.py) that `core.Engine` runs a folder on, so the TUI, `run` and `serve` take a
folder wherever they take a GGUF, with the same scheduler, KV manager and output processor.

Compute is one onnxruntime session (the graph `edgechat quantize --format onnx` writes, or
onnxruntime-genai's). The KV cache is one buffer per layer's keys and values with a row per
sequence, bound as both the past input and the present output (GroupQueryAttention writes the
new cells in place), so a token costs no copy; rewinding to a shared prefix is a shorter
attention mask. Text goes through llama.cpp's tokenizer from the folder's vocabulary GGUF, and
sampling through the same native sampler chain as the llama.cpp backend, applied to
onnxruntime's logits: the same parameters give the same choices, and the same seed the same
tokens for the same logits.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from edgechat.engine.runners.runner import ListBatch, TokenBatch
from edgechat.engine.runners.vocab import Vocabulary
from edgechat.errors import ModelFormatError, UsageError

#: rows one onnxruntime run takes at most (n_batch): bounds attention's scratch memory
PREFILL_CHUNK = 512
#: one line for a missing onnxruntime (run -m FOLDER, doctor)
MISSING = "ONNX models need onnxruntime (pip install onnxruntime; on Termux: pkg install python-onnxruntime)"
#: the optional graph input that limits the output layer to the last positions (see quantize/onnx_export.py)
LOGITS_TO_KEEP = "num_logits_to_keep"


def providers(ep: str | None) -> list[str]:
    """onnxruntime's execution providers for a name like "cpu", "xnnpack" or "CUDAExecutionProvider"."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if not ep or ep.lower() in ("cpu", "cpuexecutionprovider"):
        return ["CPUExecutionProvider"]
    wanted = ep if ep.endswith("ExecutionProvider") else None
    for name in available:
        if name == wanted or name.lower() == f"{ep.lower()}executionprovider":
            return [name, "CPUExecutionProvider"]
    raise UsageError(f"execution provider {ep!r} is not in this onnxruntime; available: {provider_names(available)}")


def provider_names(available: list[str]) -> str:
    """onnxruntime's provider names as --ep takes them: "cpu, xnnpack"."""
    return ", ".join(n.removesuffix("ExecutionProvider").lower() for n in available)


def runtime_report() -> str:
    """doctor's line: onnxruntime's version and execution providers, or that it is missing."""
    try:
        import onnxruntime as ort
    except ImportError:
        return f"onnxruntime: not installed; {MISSING}"
    return f"onnxruntime: {ort.__version__}; execution providers (--ep): {provider_names(ort.get_available_providers())}"


class OnnxRunner(Vocabulary):
    """An onnxruntime session over an ONNX folder with a KV cache of `n_seq_max` sequences of
    `n_ctx` cells each: the onnxruntime `ModelRunner` (engine/runners/runner.py), text through the
    folder's vocabulary (the `Vocabulary` it is).

    Each layer's keys and values are one numpy array (n_seq_max, n_kv, n_ctx, head), a
    sequence one row of it. A run binds a view of consecutive rows as both past and present
    (GroupQueryAttention writes the new cells in place: no copy) with one token per row, each
    row's own past length told by its attention mask (only the mask's sum per row is read:
    seqlens_k); logits of the same token alone and in a batch are identical. So a decode step of
    many sequences is one run over the rows from the lowest to the highest, any idle row between
    them fed a token at its first free cell (whose logits nobody reads), split where an idle row
    between them has no free cell. GroupQueryAttention takes several new tokens per row only
    for one row at a time (a later chunk's positions are its past length plus 0..S-1), so a
    sequence with several tokens (a prompt chunk, a token and its drafts) runs alone.

    What the cells hold is each sequence's length: cells 0..n-1 of its row. Memory can drop a
    sequence's tail, copy a prefix into another row (`seq_cp`: rows are separate, nothing is
    shared), and save or restore a row; it cannot move cells (keys are rotated by position).
    """

    can_shift = False
    shares_cells = False
    swa_window = small_swa = 0

    def __init__(self, folder: Path, n_ctx: int, n_seq_max: int, n_threads: int, ep: str | None = None,
                 n_batch: int = PREFILL_CHUNK):
        try:
            import onnxruntime as ort
        except ImportError:
            raise ModelFormatError(MISSING) from None
        self._ort = ort
        dec = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))["model"]["decoder"]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = n_threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3  # onnxruntime warns about the overridable num_logits_to_keep default
        super().__init__(folder / "tokenizer.gguf")
        try:
            self.session = ort.InferenceSession(str(folder / dec.get("filename", "model.onnx")), opts,
                                                providers=providers(ep))
        except UsageError:
            self.close()
            raise
        except Exception as exc:  # onnxruntime raises its own exception types for bad files
            self.close()
            raise ModelFormatError(f"onnxruntime cannot load {folder}: {str(exc).splitlines()[0]}") from None
        inputs = {i.name: i for i in self.session.get_inputs()}
        names_in, names_out = dec["inputs"], dec["outputs"]
        n_layer, n_kv, head = int(dec["num_hidden_layers"]), int(dec["num_key_value_heads"]), int(dec["head_size"])
        self.kv_dtype = np.float16 if inputs[names_in["past_key_names"] % 0].type == "tensor(float16)" else np.float32
        self.n_ctx, self.n_seq_max, self.n_batch = n_ctx, n_seq_max, n_batch
        self._ids_name, self._mask_name = names_in["input_ids"], names_in["attention_mask"]
        self._logits_name = names_out["logits"]
        out_type = next(o.type for o in self.session.get_outputs() if o.name == self._logits_name)
        self._logits_dtype = np.float16 if out_type == "tensor(float16)" else np.float32
        # an overridable initializer, not a graph input: bound as an OrtValue (bind_cpu_input refuses it)
        self._has_keep = any(i.name == LOGITS_TO_KEEP for i in self.session.get_overridable_initializers())
        #: (past name, present name, buffer) per key and value of every layer; zeros are not
        #: resident until written, so rows cost memory as they fill
        self._kv = [(past % i, present % i, np.zeros((n_seq_max, n_kv, n_ctx, head), self.kv_dtype))
                    for i in range(n_layer)
                    for past, present in ((names_in["past_key_names"], names_out["present_key_names"]),
                                          (names_in["past_value_names"], names_out["present_value_names"]))]
        self._bindings: dict[tuple[int, int], object] = {}  # (first row, end row) -> IOBinding over those rows
        #: how many cells of each sequence's row hold its tokens (positions 0..n-1)
        self.lengths = [0] * n_seq_max
        #: batch row -> (logits array of its run, index in it), for the rows of the last run that wanted them
        self._out: dict[int, tuple[np.ndarray, tuple[int, int]]] = {}
        self.runs = 0  # onnxruntime runs so far

    # --- compute --------------------------------------------------------------------------------
    def new_batch(self, capacity: int) -> ListBatch:
        return ListBatch(capacity)

    def decode(self, batch: TokenBatch) -> None:
        """Run the batch's rows: every sequence's one-token rows together, each sequence with
        several tokens alone. A sequence's rows must sit at consecutive positions from its length."""
        assert isinstance(batch, ListBatch), "an onnxruntime batch comes from new_batch"
        rows: dict[int, list[int]] = {}
        for i, seq in enumerate(batch.seq):
            rows.setdefault(seq, []).append(i)
        for seq, idx in rows.items():
            n = self.lengths[seq]
            assert [batch.pos[i] for i in idx] == list(range(n, n + len(idx))), \
                f"sequence {seq} holds {n} cells; rows at positions {[batch.pos[i] for i in idx]}"
            assert n + len(idx) <= self.n_ctx, f"sequence {seq}: {n + len(idx)} positions past its {self.n_ctx} cells"
        self._out = {}
        singles = sorted(seq for seq, idx in rows.items() if len(idx) == 1)
        for lo, hi in self._spans(singles):
            # an idle row inside the range gets a token at its first free cell, past what it holds
            ids = [[batch.tokens[rows[s][0]] if s in rows and len(rows[s]) == 1 else 0] for s in range(lo, hi)]
            past = self.lengths[lo:hi]
            steps = [s for s in range(lo, hi) if s in rows and len(rows[s]) == 1]
            wanted = [(rows[s][0], s - lo) for s in steps if batch.logits[rows[s][0]]]
            logits = self._run(lo, hi, ids, past, 1 if wanted else 0)
            self._out.update((row, (logits, (b, 0))) for row, b in wanted)
            for s in steps:
                self.lengths[s] += 1
        for seq, idx in rows.items():
            if len(idx) > 1:
                needs = [j for j, i in enumerate(idx) if batch.logits[i]]
                keep = len(idx) - needs[0] if needs else 0
                logits = self._run(seq, seq + 1, [[batch.tokens[i] for i in idx]], [self.lengths[seq]], keep)
                self._out.update((idx[j], (logits, (0, j - (len(idx) - keep)))) for j in needs)
                self.lengths[seq] += len(idx)

    def _spans(self, seqs: list[int]) -> list[tuple[int, int]]:
        """Rows lo..hi-1 to run together for these sorted sequences' steps: one span, cut where a
        row between two of them is full (its dummy token would have no cell to go to)."""
        spans: list[tuple[int, int]] = []
        for seq in seqs:
            if spans and all(self.lengths[r] < self.n_ctx for r in range(spans[-1][1], seq)):
                spans[-1] = (spans[-1][0], seq + 1)
            else:
                spans.append((seq, seq + 1))
        return spans

    @property
    def kv_bytes(self) -> int:
        """The KV buffers' size (the planner counts it before loading)."""
        return sum(buf.nbytes for _, _, buf in self._kv)

    def _run(self, lo: int, hi: int, ids: list[list[int]], past: list[int], keep: int) -> np.ndarray:
        """One onnxruntime run of rows lo..hi-1, `ids` after `past` cells in each; the logits of
        the last `keep` positions of each row (none: one, unread, where the graph cannot skip them)."""
        ort = self._ort
        io = self._binding(lo, hi)
        tokens = np.asarray(ids, np.int64)
        n_rows, n_new = tokens.shape
        width = max(past) + n_new
        mask = (np.arange(width) < (np.asarray(past) + n_new)[:, None]).astype(np.int64)
        io.bind_cpu_input(self._ids_name, tokens)
        io.bind_cpu_input(self._mask_name, mask)
        keep = max(keep, 1)
        if self._has_keep:
            io.bind_ortvalue_input(LOGITS_TO_KEEP, ort.OrtValue.ortvalue_from_numpy(np.array(keep, np.int64)))
        # written by onnxruntime in place; a new array per run, so logits handed out stay valid
        # (a graph without num_logits_to_keep computes every position)
        logits = np.empty((n_rows, keep if self._has_keep else n_new, self.n_vocab), self._logits_dtype)
        io.bind_ortvalue_output(self._logits_name, ort.OrtValue.ortvalue_from_numpy(logits))
        self.session.run_with_iobinding(io)
        self.runs += 1
        return logits[:, -keep:]

    def _binding(self, lo: int, hi: int):
        """The IOBinding of rows lo..hi-1, made once: views of the buffers as past and present."""
        io = self._bindings.get((lo, hi))
        if io is None:
            io = self.session.io_binding()
            for past, present, buf in self._kv:
                view = self._ort.OrtValue.ortvalue_from_numpy(buf[lo:hi])
                io.bind_ortvalue_input(past, view)
                io.bind_ortvalue_output(present, view)
            self._bindings[lo, hi] = io
        return io

    def logits(self, row: int) -> np.ndarray:
        """The logits of a row of the last run that asked for them."""
        found = self._out.get(row)
        if found is None:
            raise IndexError(f"row {row} of the last run did not ask for logits")
        logits, at = found
        return logits[at] if logits.dtype == np.float32 else logits[at].astype(np.float32)

    def argmax(self, row: int) -> int:
        return int(self.logits(row).argmax())

    def sample(self, sampler, row: int) -> int:
        return sampler.choose(self.logits(row))

    def top_logits(self, row: int, n: int) -> list[tuple[int, float]]:
        logits = self.logits(row)
        best = np.argpartition(logits, -n)[-n:]
        return sorted(((int(t), float(logits[t])) for t in best), key=lambda x: -x[1])

    # --- KV memory ------------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop positions p0..p1-1 (-1: from 0, to the end). Only a tail can go: a range in the
        middle would leave a hole the graph cannot skip, and is refused (False)."""
        n = self.lengths[seq]
        p0 = max(p0, 0)
        if p1 < 0 or p1 >= n:
            self.lengths[seq] = min(n, p0)
            return True
        return p0 >= p1  # nothing to remove

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        raise RuntimeError("ONNX KV cells cannot move: their keys are rotated for their position (can_shift is False)")

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy src's cells p0..p1-1 into dst's row (a copy: rows share nothing)."""
        p0 = max(p0, 0)
        p1 = self.lengths[src] if p1 < 0 else p1
        assert p1 <= self.lengths[src] and p0 <= self.lengths[dst], \
            f"copy of cells {p0}..{p1 - 1} from sequence {src} ({self.lengths[src]}) to {dst} ({self.lengths[dst]})"
        if src == dst or p0 >= p1:
            return
        for _, _, buf in self._kv:
            buf[dst, :, p0:p1] = buf[src, :, p0:p1]
        self.lengths[dst] = max(self.lengths[dst], p1)

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        n = self.lengths[seq]
        return (0, n - 1) if n else (-1, -1)

    def seq_cell_positions(self, seq: int) -> list[int]:
        return list(range(self.lengths[seq]))

    def _state_header(self, n: int) -> bytes:
        _, _, buf = self._kv[0]
        return _STATE_HEADER.pack(_STATE_MAGIC, n, np.dtype(self.kv_dtype).itemsize, len(self._kv), buf.shape[1], buf.shape[3])

    def state_seq_get(self, seq: int) -> bytearray:
        """The sequence's cells, every layer's keys and values, after a header that says how many
        and of what shape (state_seq_set refuses another model's or dtype's)."""
        n = self.lengths[seq]
        header = self._state_header(n)
        parts = [buf[seq, :, :n] for _, _, buf in self._kv]
        data = bytearray(len(header) + sum(p.nbytes for p in parts))
        data[: len(header)] = header
        off = len(header)
        for part in parts:
            np.frombuffer(data, self.kv_dtype, part.size, off).reshape(part.shape)[...] = part
            off += part.nbytes
        return data

    def state_seq_set(self, seq: int, data: bytes | bytearray) -> bool:
        if len(data) < _STATE_HEADER.size:
            return False
        magic, n, *_ = _STATE_HEADER.unpack_from(data, 0)
        if magic != _STATE_MAGIC or not 0 <= n <= self.n_ctx or bytes(data[: _STATE_HEADER.size]) != self._state_header(n):
            return False
        rows = [buf[seq, :, :n] for _, _, buf in self._kv]
        if len(data) != _STATE_HEADER.size + sum(r.nbytes for r in rows):
            return False  # checked first: a refused state leaves the row as it was
        off = _STATE_HEADER.size
        for cells in rows:
            cells[...] = np.frombuffer(data, self.kv_dtype, cells.size, off).reshape(cells.shape)
            off += cells.nbytes
        self.lengths[seq] = n
        return True


#: a sequence state's header: magic, cells, bytes per value, buffers (keys and values of every
#: layer), KV heads, head size
_STATE_HEADER = struct.Struct("<4sIIIII")
_STATE_MAGIC = b"EKV1"


class OnnxPlacement:
    """Where the layers run, as the TUI's status line shows it (engine.gpu.describe())."""

    def __init__(self, providers: list[str]):
        self._providers = providers

    def describe(self) -> str:
        return f"onnxruntime {self._providers[0].removesuffix('ExecutionProvider')}"
