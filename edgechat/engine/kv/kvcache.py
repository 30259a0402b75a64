"""The KV manager: the one owner of the llama.cpp KV cache.

A slot is one llama.cpp sequence. Its `tokens` list mirrors exactly what its cells hold, in
position order, so reuse is a token comparison. Cell i sits at position i, except after an M-RoPE
image (Qwen2-VL family): all of its cells sit at one position P and what follows starts at
P + n_pos, fewer positions than cells; the slot records such images (`Slot.runs`) and maps an
index to its position (`Slot.position`). An image's cells are mirrored by a run of
negative sentinels drawn from its hash (engine/runners/media.py): the same picture matches as a cached
prefix, another never does, and no cut keeps part of a run. Every cache operation (remove, shift, share,
snapshot save and restore) goes through `KVManager`, which keeps the mirrors and records which
slots share which cells, and maintains the invariant by construction:

    each sequence's cells hold exactly its mirror, at positions Slot.position(0..n-1).

With a unified cache, `llama_memory_seq_cp` does not copy: the same cell then belongs to several
sequences, and `llama_memory_seq_add` on one of them moves the cell for all. So before the cells
of a slot are moved, the cells it shares at those positions are given up by the slot that shares
them (an idle one), or the move is refused and the caller recomputes instead (a busy one).
Removing cells from one sequence (`llama_memory_seq_rm`) only drops that sequence's claim, so
truncation is always safe, and it is how speculative drafts are rolled back.

What an idle slot loses when a new request takes it over is first saved in the prompt cache
(engine/kv/promptcache.py, host RAM), and a prompt whose longest prefix is there is restored from it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from edgechat.engine.kv.prefix import NextLogits, common_prefix
from edgechat.engine.runners.runner import ModelRunner

if TYPE_CHECKING:
    from edgechat.engine.kv.promptcache import CachedPrompt, PromptCache
    from edgechat.engine.kv.sessions import Conversations

log = logging.getLogger("edgechat.engine")

#: the smallest run of tokens worth realigning the cache for after messages left it
MIN_REALIGN = 32
#: the same for a fill in the middle, whose file lost its start when the cursor moved down past
#: the prefix's budget: as llama-server's --cache-reuse 256 (what llama.vscode asks for), so a
#: short run, such as an answer that matches the new prefix, is recomputed as it is there
MIN_FILL_REALIGN = 256
#: new tokens from which llama.cpp's CPU flash attention takes its tiled path (GGML_FA_TILE_Q)
ALIGNED_PREFILL_MIN = 64
#: with the prompt cache on disk, a slot idle this long has its state written there
PROMPT_IDLE_S = 1.0
#: prompt tokens a prompt cache entry must add to what the slots hold to be restored. Loading a
#: state is a copy (SmolLM2, 2 cores: 1.7 ms for 400 tokens) while each token prefilled costs a
#: share of a model pass (4 tokens: 17 ms), so two tokens already repay it
MIN_RESTORE_GAIN = 2


@dataclass
class Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)
    session: str | None = None
    busy: bool = False
    last_used: float = 0.0
    #: the cache changed since its snapshot was written
    dirty: bool = False
    #: at its last admission: prompt tokens restored from the prompt cache (0: it had nothing
    #: longer than the slots; None: not consulted)
    cache_restored: int | None = None
    #: the logits after its first next_logits.n tokens, while those tokens are unchanged
    next_logits: NextLogits | None = None
    #: the images whose cells take fewer positions than cells (M-RoPE: every cell at the image's
    #: first position), as (start index, n_tokens, n_pos) in mirror order. Empty for every other
    #: model: its cell i sits at position i
    runs: list[tuple[int, int, int]] = field(default_factory=list)

    def position(self, i: int) -> int:
        """The position of mirror entry i (len(tokens): the next one's); inside an image, the
        image's own position."""
        pos = i
        for start, n_tokens, n_pos in self.runs:
            if i < start + n_tokens:
                return pos - max(i - start, 0)
            pos -= n_tokens - n_pos
        return pos

    @property
    def next_pos(self) -> int:
        """Where the next token or image goes."""
        return self.position(len(self.tokens))

    def cell_positions(self) -> list[int]:
        """The position of every mirror entry, in order: what llama.cpp's cells should hold."""
        out: list[int] = []
        pos = i = 0
        for start, n_tokens, n_pos in self.runs:
            out += range(pos, pos + start - i)
            pos += start - i
            out += [pos] * n_tokens
            pos, i = pos + n_pos, start + n_tokens
        out += range(pos, pos + len(self.tokens) - i)
        return out

    def runs_before(self, n: int) -> list[tuple[int, int, int]]:
        return [run for run in self.runs if run[0] < n]


def is_sentinel(entry: int) -> bool:
    """A mirror entry standing for an image's cell (engine/runners/media.py `sentinels`), not a token id."""
    return entry < 0


def find_realign(cache: list[int], prompt: list[int], start: int, min_run: int = MIN_REALIGN) -> tuple[int, int]:
    """After the common prefix `start`, find where the rest of the prompt continues in the cache.

    Returns (b, n): cache[b:b+n] == prompt[start:start+n] with the largest n found (at least
    `min_run`), or (0, 0).
    This is what lets whole evicted messages leave the cache by a position shift instead of a
    re-prefill: the prompt skips them, and the tokens after them are still in the cache.
    """
    if len(prompt) - start < min_run or len(cache) - start < min_run:
        return 0, 0
    probe = prompt[start : start + min_run]
    best_b, best_n = 0, 0
    first = probe[0]
    b = start + 1
    while True:
        try:
            b = cache.index(first, b)
        except ValueError:
            break
        if cache[b : b + min_run] == probe:
            n = common_prefix(cache[b:], prompt[start:])
            if n > best_n:
                best_b, best_n = b, n
        b += 1
    return best_b, best_n


def image_runs(tokens: list[int], cells: list[int]) -> list[tuple[int, int, int]] | None:
    """An M-RoPE mirror's `Slot.runs` read back from its sequence's sorted cell positions (a
    restored state: sentinels do not tell an image's n_pos, its grid does): an image's cells
    share one position, and the next cell's position is n_pos after it. None where the cells do
    not fit the mirror, or an image is last (nothing then gives its n_pos)."""
    if len(cells) != len(tokens):
        return None
    runs, i, n = [], 0, len(tokens)
    while i < n:
        if not is_sentinel(tokens[i]):
            i += 1
            continue
        j = i
        while j < n and is_sentinel(tokens[j]) and cells[j] == cells[i]:
            j += 1
        if j == n:
            return None
        if cells[j] - cells[i] != j - i:
            runs.append((i, j - i, cells[j] - cells[i]))
        i = j
    return runs


def short_prefix(n: int, total: int) -> bool:
    """A cached prefix of n tokens this short (a BOS, a one-line system prompt) saves under 1/32
    of a batch of `total`, while a batch that starts at position 0 runs llama.cpp's tiled
    attention in step with the causal diagonal: Gemma 3, 512 tokens from 0 take 4% less time
    than 511 after a cached BOS. Such a prefix is better prefilled again."""
    return 0 < n and total - n >= ALIGNED_PREFILL_MIN and n * 32 <= total - n


class KVInvariantError(AssertionError):
    """A sequence's cells no longer hold its mirror: a bug, never a user mistake."""


class KVManager:
    """Slots, their mirrors and sharing, and every operation on the cache (see the module doc).

    `prompt_cache` keeps the states of idle slots taken over by other prompts; `conversations`
    are where a conversation's cells and state go when its slot is given up, and come back from
    (None: no slot ever holds a conversation, as a draft model's).
    """

    def __init__(self, runner: ModelRunner, n_slots: int, *, prompt_cache: PromptCache,
                 conversations: Conversations | None = None, mrope: bool = False):
        self.runner = runner
        self.prompt_cache = prompt_cache
        self.conversations = conversations
        self.slots = [Slot(seq=i) for i in range(n_slots)]
        self._stashed: dict[int, float] = {}  # seq -> the idle spell (last_used) whose state was stashed
        # _shared[a][b]: positions 0.._shared[a][b]-1 of sequences a and b are the same cells
        self._shared = [[0] * n_slots for _ in range(n_slots)]
        #: False once the memory refused to drop part of a sequence (recurrent and hybrid
        #: models): rewinding then means recomputing, so nothing should be guessed ahead
        self.can_rewind = True
        #: images take fewer positions than cells (a Qwen2-VL projector): restored states have
        #: their runs read back from their cells
        self.mrope = mrope

    @property
    def can_shift(self) -> bool:
        return self.runner.can_shift

    # ------------------------------------------------------------------ queries
    def slot_of(self, session: str | None) -> Slot | None:
        if session is None:
            return None
        return next((s for s in self.slots if s.session == session), None)

    def positions(self, slot: Slot) -> tuple[int, int, int]:
        """(pos_min, pos_max) as llama.cpp reports them, and the mirror's length."""
        lo, hi = self.runner.seq_pos_range(slot.seq)
        return lo, hi, len(slot.tokens)

    def check(self) -> list[str]:
        """Compare every mirror with llama.cpp's own view; return what disagrees.

        Each sequence's cell positions are read from llama.cpp's serialized state (the only API
        that lists them), so a cell moved under another sequence, a duplicate or a hole is seen,
        not only a wrong minimum or maximum."""
        problems = []
        for slot in self.slots:
            n = len(slot.tokens)
            last = slot.position(n - 1) if n else -1
            lo, hi = self.runner.seq_pos_range(slot.seq)
            want = (0, last) if n else (-1, -1)
            window = self.runner.swa_window
            if window and n and hi == last and 0 <= lo <= max(n - window, 0):
                # a sliding-window model reports its sliding layers' oldest cell, which moves on
                # past the window in a small cache or a restored state; the full-attention
                # layers' cells are checked below
                lo = 0
            if slot.next_logits is not None and slot.next_logits.n > n:
                problems.append(f"seq {slot.seq}: logits kept for position {slot.next_logits.n}, past its {n} tokens")
            if (lo, hi) != want:
                problems.append(f"seq {slot.seq}: llama.cpp holds positions {lo}..{hi}, the mirror {n} tokens")
                continue
            if n:
                cells = self.runner.seq_cell_positions(slot.seq)
                if cells != slot.cell_positions():
                    extra = len(cells) - n
                    problems.append(f"seq {slot.seq}: {len(cells)} cells ({extra:+d}) do not sit at positions 0..{last}")
        for a in self.slots:
            for b in self.slots:
                s = self._shared[a.seq][b.seq]
                if a is not b and (s > min(len(a.tokens), len(b.tokens)) or a.tokens[:s] != b.tokens[:s]):
                    problems.append(f"seq {a.seq} and {b.seq} share {s} cells whose tokens differ")
        return problems

    # ------------------------------------------------------------------ operations
    def extend(self, slot: Slot, tokens: list[int], n_pos: int | None = None) -> None:
        """The caller put these tokens in a batch at positions slot.next_pos.., or an image's
        cells (`n_pos`: the positions the image took)."""
        if n_pos is not None and n_pos != len(tokens):
            slot.runs.append((len(slot.tokens), len(tokens), n_pos))
        slot.tokens.extend(tokens)

    def truncate(self, slot: Slot, n: int) -> int:
        """Keep positions 0..n-1 and drop the rest; returns what is kept. Memory that cannot drop
        part of a sequence (recurrent and hybrid models) is cleared whole instead."""
        n = max(min(n, len(slot.tokens)), 0)
        if n == len(slot.tokens) and n:
            return n
        tokens = slot.tokens
        while 0 < n < len(tokens) and is_sentinel(tokens[n - 1]) and is_sentinel(tokens[n]):
            # never part of an image (a run of sentinels): finishing
            # it would need its embeddings again, and a non-causal image's cells saw each other
            n -= 1
        # an M-RoPE image's cells all sit at its position: a cut there drops it whole
        if not self.runner.seq_rm(slot.seq, slot.position(n) if n else -1, -1):
            if not self.runner.seq_rm(slot.seq, -1, -1):
                raise KVInvariantError(f"llama.cpp refused to clear sequence {slot.seq}")
            n = 0
            # sliding layers refuse only rewinds deeper than the window they still hold
            # (llama.py); a draft's rollback stays inside the batch just decoded, whose window
            # llama.cpp never overwrites, so speculation goes on
            if not self.runner.swa_window:
                self.can_rewind = False
        del slot.tokens[n:]
        slot.runs = slot.runs_before(n)
        if slot.next_logits is not None and slot.next_logits.n > n:
            slot.next_logits = None
        self._limit_sharing(slot, n)
        return n

    def clear(self, slot: Slot) -> None:
        self.truncate(slot, 0)

    def share(self, dst: Slot, src: Slot, n: int) -> None:
        """dst takes src's first n cells (unified cache: the same cells, no copy; a runner whose
        memory cannot share cells copies them, and nothing is shared after)."""
        self.clear(dst)
        n = next((start for start, k, _ in src.runs if start < n < start + k), n)  # never part of an image
        self.runner.seq_cp(src.seq, dst.seq, 0, src.position(n))
        dst.tokens, dst.runs = src.tokens[:n], src.runs_before(n)
        if src.next_logits is not None and src.next_logits.n <= n:
            dst.next_logits = src.next_logits
        if not self.runner.shares_cells:
            return
        for other in self.slots:
            if other is not dst:
                s = n if other is src else min(self._shared[src.seq][other.seq], n)
                self._shared[dst.seq][other.seq] = self._shared[other.seq][dst.seq] = s

    def drop(self, slot: Slot, a: int, b: int) -> bool:
        """Remove positions a..b-1 and move the rest down, no recompute. False when that is not
        possible: the memory cannot shift, or a busy sequence shares cells that would move."""
        if not self.can_shift or not 0 <= a < b <= len(slot.tokens):
            return False
        sharers = [o for o in self.slots if o is not slot and self._shared[slot.seq][o.seq] > b]
        if any(o.busy for o in sharers):
            return False
        for other in sharers:
            self._give_up(other, b)
        if not self.runner.seq_rm(slot.seq, a, b):
            return False
        if b < len(slot.tokens):
            self.runner.seq_add(slot.seq, b, -1, -(b - a))
        slot.tokens[a:b] = []
        if slot.next_logits is not None and slot.next_logits.n > a:
            slot.next_logits = None
        self._limit_sharing(slot, a)
        slot.dirty = slot.session is not None
        return True

    def _give_up(self, other: Slot, n: int) -> None:
        """An idle slot lets go of its cells from position n on, so they can move under another.
        A conversation is saved first and then leaves memory whole: its next turn restores it."""
        if other.session is not None and self.save_snapshot(other):
            self.clear(other)
            other.session = None
        else:
            self.stash(other)
            self.truncate(other, n)

    def _limit_sharing(self, slot: Slot, n: int) -> None:
        row = self._shared[slot.seq]
        for other in range(len(row)):
            if row[other] > n:
                row[other] = self._shared[other][slot.seq] = n

    # ------------------------------------------------------------------ admission
    def pick(self, session: str | None, prompt: list[int], n_ctx: int) -> Slot | None:
        """The slot for a new request, with the longest reusable cache: the conversation's own
        sequence or snapshot, or a free one (sharing the longest prefix another slot holds)."""
        own = self.slot_of(session)
        if own is not None:
            return None if own.busy else own
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None
        # prefer slots nobody's conversation lives in, then the one whose cache loses least (an
        # empty slot loses nothing: a prefix another slot holds is shared into it below), then LRU
        free.sort(key=lambda s: (s.session is not None, len(s.tokens) - common_prefix(s.tokens, prompt), s.last_used))
        slot = free[0]
        stash = None
        if slot.session is not None:
            self.save_snapshot(slot)  # spill the least recently used conversation to disk
        elif common_prefix(slot.tokens, prompt) < len(slot.tokens):
            stash = self._state_to_stash(slot)  # cells about to go: a later prompt may start with them
        slot.session = session
        self._load_prefix(slot, session, prompt, n_ctx)
        if stash is not None:
            # stored after the restore made its entry the most recently used: never evicted by it
            self.prompt_cache.put(*stash)
        return slot

    def pick_alone(self, session: str | None) -> Slot:
        """Deterministic mode: every cell is given up (conversations to their snapshots) and the
        request gets the first sequence of an empty cache, so its prompt is prefilled into the same
        cells in the same batches every time it is sent. Cells computed in another shape (another
        turn's, a batch shared with others) would round differently: none is reused."""
        for slot in self.slots:
            self.save_snapshot(slot)
            self.forget(slot)
        slot = self.slots[0]
        slot.session, slot.cache_restored = session, None
        return slot

    def _load_prefix(self, slot: Slot, session: str | None, prompt: list[int], n_ctx: int) -> None:
        slot.cache_restored = None
        if session is not None and self.restore_snapshot(slot, session, n_ctx):
            return
        # another sequence may already hold a longer prefix (a shared system prompt): share its cells
        mine = common_prefix(slot.tokens, prompt)
        donor = max(self.slots, key=lambda s: common_prefix(s.tokens, prompt))
        theirs = common_prefix(donor.tokens, prompt)
        if self._prompt_cache_usable():
            # a file on disk is read only if it could beat what the slots hold
            entry, n = self.prompt_cache.longest(prompt, beyond=max(mine, theirs) + MIN_RESTORE_GAIN - 1)
            slot.cache_restored = 0
            if entry is not None and n >= max(mine, theirs) + MIN_RESTORE_GAIN and not short_prefix(n, len(prompt)) and self.restore_prompt(slot, entry):
                slot.cache_restored = n
                return
        if donor is not slot and theirs > mine:
            self.share(slot, donor, theirs)

    def reuse(self, slot: Slot, prompt: list[int], realign: bool, min_run: int = MIN_REALIGN) -> int:
        """Make the slot's cache a prefix of the prompt, keeping as much as possible; returns how
        many prompt tokens are cached (all of them only where the slot kept the logits after the
        prompt; else its last token is decoded again for them). With `realign`, messages that
        left the prompt leave the cache by a shift (the rest of the cache moves down) instead of
        a recompute, where at least `min_run` tokens after them are kept."""
        n = common_prefix(slot.tokens, prompt)
        if n < len(slot.tokens) and realign:
            b, m = find_realign(slot.tokens, prompt, n, min_run)
            if m and self.drop(slot, n, b):
                n = common_prefix(slot.tokens, prompt)
        self.truncate(slot, n)
        n = len(slot.tokens)
        if short_prefix(n, len(prompt)):
            n = self.truncate(slot, 0)
        if n == len(prompt) and (slot.next_logits is None or slot.next_logits.n != n):
            # everything is cached, but the logits are not: recompute the last prompt token
            n = self.truncate(slot, n - 1)
        return n

    # ------------------------------------------------------------------ snapshots
    def save_snapshot(self, slot: Slot) -> bool:
        """Write a changed conversation's cells to disk; True when its snapshot is current."""
        if not slot.session or not slot.tokens:
            return False
        if not slot.dirty:
            return True
        conv = self._conversations()
        try:
            data = self.runner.state_seq_get(slot.seq)
            conv.snapshots.save(slot.session, slot.tokens, conv.states.get(slot.session) or {}, data)
        except OSError as exc:
            log.warning("could not save the KV snapshot of %s: %s", slot.session, exc)
            return False
        slot.dirty = False
        return True

    def restore_snapshot(self, slot: Slot, session: str, n_ctx: int) -> bool:
        """Load a conversation's snapshot into the slot; False leaves the slot empty (the
        conversation is then rebuilt by prefill)."""
        self.clear(slot)
        slot.session = session
        conv = self._conversations()
        try:
            snap = conv.snapshots.load(session)
        except OSError as exc:
            log.warning("could not read the KV snapshot of %s: %s", session, exc)
            return False
        if snap is None or len(snap.tokens) > n_ctx:
            return False
        if not self.runner.state_seq_set(slot.seq, snap.data) or not self._restored_mirror(slot, snap.tokens):
            self.clear(slot)
            return False
        slot.dirty = False
        conv.states.update(session, **snap.session_state)
        return True

    def _conversations(self) -> Conversations:
        if self.conversations is None:
            raise AssertionError("this cache keeps no conversations: none of its slots holds one")
        return self.conversations

    # ------------------------------------------------------------------ the prompt cache
    def _prompt_cache_usable(self) -> bool:
        # a restored state is cut back to the prefix a prompt shares with it: memory that cannot
        # drop part of a sequence, or a small SWA cache past its window, could only recompute
        pc = self.prompt_cache
        return pc.enabled and self.can_rewind and not self.runner.small_swa

    def stash(self, slot: Slot) -> None:
        """An idle slot is about to lose cells: keep its state in the prompt cache."""
        if (stash := self._state_to_stash(slot)) is not None:
            self.prompt_cache.put(*stash)

    def stash_idle(self, at_close: bool = False) -> float | None:
        """Each idle slot's state joins the prompt cache (whose disk tier writes it) once the slot
        has idled PROMPT_IDLE_S, or at close, so a hot prefix a slot holds outlives the process
        too. Returns the seconds until the next is due (None: none)."""
        now, due = time.monotonic(), None
        for slot in self.slots:
            if slot.busy or slot.session is not None or not slot.tokens or self._stashed.get(slot.seq) == slot.last_used:
                continue
            wait = slot.last_used + PROMPT_IDLE_S - now
            if wait <= 0 or at_close:
                self.stash(slot)
                self._stashed[slot.seq] = slot.last_used
            else:
                due = wait if due is None else min(due, wait)
        return due

    def _state_to_stash(self, slot: Slot) -> tuple[list[int], bytearray, NextLogits | None] | None:
        """The tokens, state and kept logits of an idle slot for the prompt cache (prompt and
        answer: a follow-up request starts with both), unless an entry already holds them."""
        if slot.busy or not slot.tokens or not self._prompt_cache_usable() or self.prompt_cache.covers(slot.tokens):
            return None
        return list(slot.tokens), self.runner.state_seq_get(slot.seq), slot.next_logits

    def restore_prompt(self, slot: Slot, entry: CachedPrompt) -> bool:
        """Load a prompt cache entry into the slot; False leaves the slot empty and drops the
        entry: a state llama.cpp refuses, or whose cells are not at 0..n-1, is never used. That
        includes a sliding-window model's state longer than its window: llama.cpp leaves the
        sliding layers' older cells out of it, so it could not be cut back to a shorter prompt
        (their oldest cell is then past 0)."""
        self.clear(slot)
        n = len(entry.tokens)
        if not self.runner.state_seq_set(slot.seq, entry.data) or not self._restored_mirror(slot, entry.tokens, check=True):
            log.info("a prompt cache entry of %d tokens could not be used; it is dropped", n)
            self.clear(slot)
            self.prompt_cache.drop(entry)
            return False
        slot.next_logits = entry.next_logits
        self.prompt_cache.touch(entry)
        return True

    def _restored_mirror(self, slot: Slot, tokens: list[int], check: bool = False) -> bool:
        """A state was loaded into the slot: take its mirror, and for M-RoPE images their runs from
        the cells. False where the cells do not fit (`check`: their range is tested for any model)."""
        if self.mrope and any(is_sentinel(t) for t in tokens):
            cells = self.runner.seq_cell_positions(slot.seq)
            runs = image_runs(tokens, cells)
            if runs is None or Slot(slot.seq, list(tokens), runs=runs).cell_positions() != cells:
                return False
            slot.tokens, slot.runs = list(tokens), runs
            return True
        if check and self.runner.seq_pos_range(slot.seq) != (0, len(tokens) - 1):
            return False
        slot.tokens, slot.runs = list(tokens), []
        return True

    def forget(self, slot: Slot) -> None:
        self.clear(slot)
        slot.session = None

    def occupy(self, slot: Slot) -> None:
        """A request starts on this slot: its cells are not given up or moved under it."""
        slot.busy = True

    def keep_logits(self, slot: Slot, values: np.ndarray) -> None:
        """The logits after the slot's cells as they are now (a prompt just read), kept for a
        later prompt that ends there (read-only: slots and prompt cache entries share them)."""
        slot.next_logits = NextLogits(len(slot.tokens), values)

    def release(self, slot: Slot) -> None:
        """A request on this slot ended: the cells stay for reuse, and a conversation's
        snapshot is out of date."""
        slot.busy = False
        slot.last_used = time.monotonic()
        slot.dirty = slot.session is not None
