"""Consistency checks the tests and benches ask the engine for, run on its thread between steps:
what greedy decoding appends to a cached sequence or to tokens prefilled cold, and the highest
logits after some tokens. They borrow an idle sequence and leave the cache as its mirror says."""

from __future__ import annotations

from edgechat.engine.kv.kvcache import KVManager, Slot
from edgechat.engine.schedule.scheduler import Scheduler


def continuation(scheduler: Scheduler, n: int, session: str | None, tokens: list[int] | None) -> list[int]:
    """n greedy tokens after a session's cached sequence (left as it was), or after `tokens`
    prefilled cold in an idle sequence."""
    kv = scheduler.kv
    if session is not None:
        slot = kv.slot_of(session)
        if slot is None or slot.busy or not slot.tokens:
            raise ValueError(f"no idle cached sequence for {session!r}")
        keep = len(slot.tokens)
        prefix = slot.tokens[-1:]
        kv.truncate(slot, keep - 1)  # its logits are gone: decode the last token again
    else:
        slot, keep, prefix = _cold_slot(kv), 0, list(tokens or [])
    out: list[int] = []
    try:
        while len(out) < n:
            idx = scheduler.prefill.now(slot, prefix, logits_last=True)
            prefix = [scheduler.runner.argmax(idx)]
            out.append(prefix[0])
    finally:
        kv.truncate(slot, keep)
    return out


def top_logits(scheduler: Scheduler, tokens: list[int], n: int) -> list[tuple[int, float]]:
    """For checking near-ties: the n highest logits after `tokens`, prefilled cold."""
    slot = _cold_slot(scheduler.kv)
    try:
        return scheduler.runner.top_logits(scheduler.prefill.now(slot, list(tokens), logits_last=True), n)
    finally:
        scheduler.kv.clear(slot)


def _cold_slot(kv: KVManager) -> Slot:
    """An idle sequence, emptied; a conversation's only if need be (spilled to its snapshot)."""
    slot = min((s for s in kv.slots if not s.busy), key=lambda s: s.session is not None, default=None)
    if slot is None:
        raise ValueError("no idle sequence to prefill into")
    kv.save_snapshot(slot)
    kv.forget(slot)
    return slot
