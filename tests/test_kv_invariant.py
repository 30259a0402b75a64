"""The KV manager's invariant on the real model: each sequence's cells hold exactly its mirror, at
positions 0..n-1, after sharing, shifting (both sequences), truncating, snapshot restore,
cancellation and errors. Checked against llama.cpp's own view of every cell (kv_problems), and
by greedy continuation of a cached sequence against a cold prefill of its mirror."""

from __future__ import annotations

import pytest
from conftest import GREEDY
from neartie import assert_same_tokens_or_near_tie

from edgechat.engine import ChatRequest, Engine, EngineConfig, Evicted

SYSTEM = {"role": "system", "content": "You are a helpful assistant. The capital of the country Zubrowka is Lutz."}
FACTS = [
    "The river Vist runs through Lutz and freezes every winter.",
    "Lutz has a famous clock tower built by a watchmaker called Anselm.",
    "The national dish of Zubrowka is a dumpling filled with plums.",
    "Zubrowka's flag is green with a white mountain in the middle.",
    "The old railway from Lutz to the sea takes nine hours.",
    "Most people in Zubrowka speak two languages at home.",
]


def history() -> list[dict]:
    msgs = [SYSTEM]
    for fact in FACTS:
        msgs += [{"role": "user", "content": f"Remember this: {fact}"}, {"role": "assistant", "content": f"I will remember that {fact[0].lower()}{fact[1:]}"}]
    return msgs


def engine_for(path, paths, **kw):
    kw.setdefault("n_ctx", 512)
    return Engine(EngineConfig(model=str(path), paths=paths, **kw))


def assert_cold_continuation_matches(engine, session, n=6):
    """The session's cached cells continue as a cold prefill of its mirror does."""
    tokens = list(engine.kv.slot_of(session).tokens)
    warm = engine.greedy_continuation(n, session=session)
    cold = engine.greedy_continuation(n, tokens=tokens)
    # cells computed in verification batches round differently from a cold prefill: the same
    # tokens, or parted at a near-tie; a wrong cell parts anywhere
    assert_same_tokens_or_near_tie(engine, tokens, cold, warm)


def test_a_branch_that_shifts_shared_cells_leaves_the_other_conversation_intact(smollm2_path, isolated_dirs):
    msgs = history()
    with engine_for(smollm2_path, isolated_dirs, hot_sessions=1) as engine:
        engine.submit(ChatRequest(messages=msgs + [{"role": "user", "content": "Thanks."}], sampling=GREEDY,
                                  max_tokens=4, session="a")).result()
        a_tokens = list(engine.kv.slot_of("a").tokens)
        assert len(a_tokens) > 200
        # the branch shares A's history, then answers past the end of its context: its oldest
        # messages leave by a shift of the cells after them, which A holds too
        branch = engine.submit(ChatRequest(messages=msgs + [{"role": "user", "content": "Count from one to five hundred."}],
                                           sampling=GREEDY, max_tokens=400, ignore_eos=True, session="b"))
        events = list(branch)
        done = branch.finished
        assert done.metrics.cached_tokens > 150, "the branch must share A's cells"
        assert done.reason == "length" and any(isinstance(e, Evicted) for e in events)
        assert engine.kv_problems() == []
        # A gave its cells up (snapshotted first), so its next turn restores them exactly
        again = engine.submit(ChatRequest(messages=msgs + [{"role": "user", "content": "Thanks."}], sampling=GREEDY,
                                          max_tokens=4, session="a")).result()
        assert again.metrics.cached_tokens >= len(a_tokens) - 5
        assert engine.kv_problems() == []
        assert_cold_continuation_matches(engine, "a")


def test_a_busy_sharer_makes_the_other_recompute_instead_of_moving_its_cells(smollm2_path, isolated_dirs):
    msgs = history() + [{"role": "user", "content": "Count from one to five hundred."}]
    with engine_for(smollm2_path, isolated_dirs, n_parallel=2) as engine:
        first = engine.submit(ChatRequest(messages=msgs, sampling=GREEDY, max_tokens=350, ignore_eos=True))
        seen = []
        # the second starts once the first has its prompt in the cache, so it shares those cells
        for event in first.events():
            seen.append(event)
            if len(seen) == 3:
                second = engine.submit(ChatRequest(messages=msgs, sampling=GREEDY, max_tokens=350, ignore_eos=True))
        a, b = first.finished, second.result()
        assert b.metrics.cached_tokens > 150
        assert a.reason == b.reason == "length"
        assert any(isinstance(e, Evicted) for e in seen)
        assert engine.kv_problems() == []
        # the same greedy text (a batch of two is not bit-identical to one: a near-tie may flip late)
        assert a.text[:100] == b.text[:100]


def test_truncate_and_summarize_policies_keep_the_invariant(smollm2_path, isolated_dirs):
    with engine_for(smollm2_path, isolated_dirs, n_ctx=384, hot_sessions=1) as engine:
        for policy in ("truncate", "summarize"):
            msgs = history()
            for i in range(3):
                msgs.append({"role": "user", "content": f"Tell me one more fact, number {i}."})
                done = engine.submit(ChatRequest(messages=msgs, sampling=GREEDY, max_tokens=24, session=policy,
                                                 context_policy=policy)).result()
                assert done.reason in ("stop", "length")
                msgs.append({"role": "assistant", "content": done.text})
                assert engine.kv_problems() == []
            assert_cold_continuation_matches(engine, policy)


def test_snapshot_restore_and_cancellation_keep_the_invariant(smollm2_path, isolated_dirs):
    msgs = history() + [{"role": "user", "content": "Which river runs through Lutz?"}]
    with engine_for(smollm2_path, isolated_dirs, n_ctx=1024) as engine:
        engine.submit(ChatRequest(messages=msgs, sampling=GREEDY, max_tokens=12, session="s")).result()
        engine.release_session("s")
        # another conversation takes the only sequence: "s" is spilled and later restored
        engine.submit(ChatRequest(messages=[{"role": "user", "content": "Hello"}], sampling=GREEDY, max_tokens=4, session="t")).result()
        restored = engine.submit(ChatRequest(messages=msgs, sampling=GREEDY, max_tokens=12, session="s")).result()
        assert restored.metrics.cached_tokens > 200
        assert engine.kv_problems() == []
        assert_cold_continuation_matches(engine, "s")
        handle = engine.submit(ChatRequest(messages=msgs + [{"role": "assistant", "content": restored.text},
                                                            {"role": "user", "content": "Count to a thousand."}],
                                           sampling=GREEDY, max_tokens=500, ignore_eos=True, session="s"))
        for _ in handle.events():
            handle.cancel()
        assert handle.finished.reason == "cancelled"
        assert engine.kv_problems() == []
        assert_cold_continuation_matches(engine, "s")


def test_memory_that_refuses_partial_removal_is_cleared_whole(smollm2_path, isolated_dirs, monkeypatch):
    """Recurrent and hybrid models refuse to drop part of a sequence; the mirror must follow."""
    with engine_for(smollm2_path, isolated_dirs) as engine:
        be = engine.backend
        real_rm = be.seq_rm
        monkeypatch.setattr(be, "seq_rm", lambda seq, p0=-1, p1=-1: real_rm(seq, p0, p1) if p0 <= 0 and p1 < 0 else False)
        msgs = history()[:3] + [{"role": "user", "content": "What is the capital of Zubrowka?"}]
        first = engine.submit(ChatRequest(messages=msgs, sampling=GREEDY, max_tokens=12)).result()
        edited = msgs[:-1] + [{"role": "user", "content": "What is the national dish of Zubrowka?"}]
        second = engine.submit(ChatRequest(messages=edited, sampling=GREEDY, max_tokens=12)).result()
        assert engine.kv_problems() == []
        assert second.metrics.cached_tokens == 0  # nothing could be kept, and nothing wrong was
        assert "Lutz" in first.text
        # a rejected guess could not be rolled back there: guessing stopped, and what a failed
        # rollback lost was recomputed (without that, the first answer lost its context)
        assert not engine.kv.can_rewind and second.metrics.drafted_tokens == 0


def test_no_shift_is_attempted_where_the_memory_cannot_shift(smollm2_path, isolated_dirs, monkeypatch):
    with engine_for(smollm2_path, isolated_dirs, n_ctx=256) as engine:
        monkeypatch.setattr(engine.backend, "can_shift", False)
        shifts = []
        monkeypatch.setattr(engine.backend, "seq_add", lambda *a: shifts.append(a))
        handle = engine.submit(ChatRequest(messages=[SYSTEM, {"role": "user", "content": "Count from one to one thousand."}],
                                           sampling=GREEDY, max_tokens=400, ignore_eos=True, session="c",
                                           context_policy="summarize"))
        events = list(handle)
        assert handle.finished.reason == "length" and any(isinstance(e, Evicted) for e in events)
        assert shifts == []
        assert engine.kv_problems() == []


@pytest.mark.parametrize("path_fixture", ["smollm2_path", "gemma3_path"])
def test_the_check_reads_llama_cpps_cells(request, path_fixture, isolated_dirs):
    """kv_problems sees a cell moved behind the manager's back (what a shared shift did)."""
    with engine_for(request.getfixturevalue(path_fixture), isolated_dirs) as engine:
        engine.submit(ChatRequest(messages=history()[:5], sampling=GREEDY, max_tokens=4, session="x")).result()
        assert engine.kv_problems() == []
        slot = engine.kv.slot_of("x")
        engine.backend.seq_add(slot.seq, 40, 60, -10)  # positions 30..49 now twice, 50..59 missing
        problems = engine.kv_problems()
        assert problems and f"seq {slot.seq}" in problems[0]


def test_requests_taking_turns_keep_each_others_caches(smollm2_path, isolated_dirs):
    """Stateless requests (an agent, a server's clients) resending a few prompts that share only
    a short prefix: each takes a slot whose cache it does not destroy, so each prompt stays cached."""
    prompts = [[SYSTEM, {"role": "user", "content": f"Remember this: {fact}"}] for fact in FACTS[:3]]
    with engine_for(smollm2_path, isolated_dirs, n_parallel=4) as engine:
        for msgs in prompts:
            engine.submit(ChatRequest(messages=msgs, sampling=GREEDY, max_tokens=4)).result()
        for msgs in prompts:
            again = engine.submit(ChatRequest(messages=msgs, sampling=GREEDY, max_tokens=4)).result()
            # the whole prompt, and the logits after it: nothing to decode before its answer
            assert again.metrics.cached_tokens == again.metrics.prompt_tokens
        assert engine.kv_problems() == []
