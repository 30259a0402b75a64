"""The KV cache manager on the real model: prefix reuse, eviction policies, snapshots."""

from __future__ import annotations

import pytest
from conftest import GREEDY

from edgechat.engine import ChatRequest, Engine, EngineConfig, Evicted
from edgechat.engine.kv.snapshots import snapshot_path

SYSTEM = {"role": "system", "content": "The capital of the country Zubrowka is Lutz."}
QUESTION = "What is the capital of Zubrowka?"


def engine_for(model, paths, n_ctx=512, **kw):
    return Engine(EngineConfig(model=str(model), n_ctx=n_ctx, paths=paths, **kw))


def turn(engine, history, text, session, policy="shift", max_tokens=16):
    history.append({"role": "user", "content": text})
    handle = engine.submit(ChatRequest(messages=[SYSTEM] + history, sampling=GREEDY, max_tokens=max_tokens,
                                       session=session, context_policy=policy))
    events = list(handle)
    done = handle.finished
    history.append({"role": "assistant", "content": done.text})
    return done, [e for e in events if isinstance(e, Evicted)]


def assert_positions_consistent(engine, session):
    lo, hi, mirrored = engine.seq_positions(session)
    assert lo == 0 and hi == mirrored - 1
    assert engine.kv_problems() == []  # every cell, as llama.cpp holds it


def test_each_turn_prefills_only_what_is_new(smollm2_path, isolated_dirs):
    with engine_for(smollm2_path, isolated_dirs, n_ctx=2048) as engine:
        history: list[dict] = []
        first, _ = turn(engine, history, "Tell me one short fact about the number 1.", "chat")
        second, _ = turn(engine, history, "Tell me one short fact about the number 2.", "chat")
        third, _ = turn(engine, history, "Tell me one short fact about the number 3.", "chat")
        assert first.metrics.cached_tokens == 0
        # everything up to the previous answer comes from the cache
        assert second.metrics.cached_tokens >= first.metrics.prompt_tokens
        assert third.metrics.cached_tokens >= second.metrics.prompt_tokens
        assert third.metrics.prompt_tokens - third.metrics.cached_tokens < 40
        # editing the last question reuses everything before it
        history = history[:-2]
        edited, _ = turn(engine, history, "Tell me one short fact about the number 7.", "chat")
        assert edited.metrics.cached_tokens >= second.metrics.prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["shift", "truncate", "summarize"])
def test_thirty_turns_in_a_small_context_keep_the_pinned_fact(smollm2_path, isolated_dirs, policy):
    with engine_for(smollm2_path, isolated_dirs, n_ctx=512) as engine:
        history: list[dict] = []
        evictions = []
        for i in range(30):
            done, evicted = turn(engine, history, f"Tell me one short fact about the number {i + 1}.", "long", policy)
            assert done.reason in ("stop", "length")
            assert done.metrics.context_tokens <= 512
            evictions += evicted
            assert_positions_consistent(engine, "long")
        assert evictions, "a 30-turn chat must outgrow a 512-token context"
        assert all("left the context" in e.note for e in evictions)
        assert len(history) == 60  # the conversation itself is never cut
        done, _ = turn(engine, history, QUESTION, "long", policy)
        assert "Lutz" in done.text


def test_an_answer_three_times_the_context_completes_under_shift(smollm2_path, isolated_dirs):
    with engine_for(smollm2_path, isolated_dirs, n_ctx=256) as engine:
        handle = engine.submit(ChatRequest(messages=[SYSTEM, {"role": "user", "content": "Count from one to one thousand."}],
                                           sampling=GREEDY, max_tokens=768, ignore_eos=True, session="count"))
        events = list(handle)
        done = handle.finished
        assert done.reason == "length" and done.metrics.completion_tokens == 768
        assert any(isinstance(e, Evicted) for e in events)
        assert done.metrics.context_tokens <= 256
        assert_positions_consistent(engine, "count")


def _two_turns(engine, session):
    history: list[dict] = []
    turn(engine, history, "Tell me one short fact about the number 5.", session)
    turn(engine, history, "And one about the number 6.", session)
    return history


def test_snapshot_round_trip_matches_a_cold_prefill(smollm2_path, isolated_dirs, tmp_path):
    with engine_for(smollm2_path, isolated_dirs) as engine:
        history = _two_turns(engine, "snap")
        engine.release_session("snap")
    assert snapshot_path(isolated_dirs.snapshots, "snap").is_file()
    with engine_for(smollm2_path, isolated_dirs) as engine:
        warm, _ = turn(engine, list(history), QUESTION, "snap")
    from edgechat.config import get_paths

    with engine_for(smollm2_path, get_paths(tmp_path / "elsewhere")) as engine:
        cold, _ = turn(engine, list(history), QUESTION, "snap")
    assert warm.metrics.cached_tokens > 50 and cold.metrics.cached_tokens == 0
    assert warm.text == cold.text and "Lutz" in warm.text


def test_bad_snapshots_are_rebuilt_not_trusted(smollm2_path, gemma3_path, isolated_dirs):
    with engine_for(smollm2_path, isolated_dirs) as engine:
        history = _two_turns(engine, "s1")
    path = snapshot_path(isolated_dirs.snapshots, "s1")
    good = path.read_bytes()

    # corrupt: garbage, then a truncated file
    for damaged in (b"\x00garbage" * 100, good[: len(good) // 3]):
        path.write_bytes(damaged)
        with engine_for(smollm2_path, isolated_dirs) as engine:
            done, _ = turn(engine, list(history), QUESTION, "s1")
        assert done.metrics.cached_tokens == 0 and "Lutz" in done.text

    # another context size
    path.write_bytes(good)
    with engine_for(smollm2_path, isolated_dirs, n_ctx=1024) as engine:
        done, _ = turn(engine, list(history), QUESTION, "s1")
    assert done.metrics.cached_tokens == 0 and "Lutz" in done.text

    # another model
    path.write_bytes(good)
    with engine_for(gemma3_path, isolated_dirs) as engine:
        done, _ = turn(engine, list(history), QUESTION, "s1", max_tokens=4)
    assert done.metrics.cached_tokens == 0


def test_a_sliding_window_snapshot_restores_into_its_own_cache_kind_and_rewinds_safely(gemma3_path, isolated_dirs, tmp_path):
    """llama.cpp's state of a long Gemma 3 conversation leaves out the sliding layers' cells older
    than the window, whatever the cache: restored, it answers as before; a rewind deeper than the
    window recomputes rather than attending to cells that are not there; and a state is never
    restored into the other cache kind (the small cache holds only the window)."""
    from neartie import assert_same_or_near_tie

    from edgechat.config import get_paths

    story = " ".join(f"Line {i}: the river stones are smooth and grey." for i in range(90))  # past the 512 window
    history = [{"role": "user", "content": story}]
    with engine_for(gemma3_path, isolated_dirs, n_ctx=2048, swa_cache="full") as engine:
        turn(engine, history, "What colour are the stones?", "swa", max_tokens=8)
        engine.release_session("swa")
    edited = [{"role": "user", "content": story[: len(story) // 3] + " The end."}]
    for kind, reused in (("full", True), ("small", False)):
        with engine_for(gemma3_path, isolated_dirs, n_ctx=2048, swa_cache=kind) as engine:
            done, _ = turn(engine, list(history), "And the river?", "swa", max_tokens=8)
            assert (done.metrics.cached_tokens > 500) is reused, (kind, done.metrics.cached_tokens)
            assert engine.kv_problems() == []
            engine.release_session("swa")
        if kind == "full":
            # an edit a third of the way in: the restored sequence cannot rewind that deep
            with engine_for(gemma3_path, isolated_dirs, n_ctx=2048, swa_cache=kind) as engine:
                got, _ = turn(engine, list(edited), "What colour are the stones?", "swa", max_tokens=8)
                assert got.metrics.cached_tokens == 0 and engine.kv_problems() == []
            with engine_for(gemma3_path, get_paths(tmp_path / "cold"), n_ctx=2048, swa_cache=kind) as engine:
                cold, _ = turn(engine, list(edited), "What colour are the stones?", "swa", max_tokens=8)
                assert_same_or_near_tie(engine, [SYSTEM] + list(edited) + [{"role": "user", "content": "What colour are the stones?"}],
                                        cold.token_ids, got.token_ids)


def test_identical_system_prompts_share_their_kv(smollm2_path, isolated_dirs):
    with engine_for(smollm2_path, isolated_dirs, hot_sessions=1) as engine:
        turn(engine, [], "Hello!", "a")
        second, _ = turn(engine, [], "Good morning!", "b")
        n_system = len(engine.prompt_tokens(ChatRequest(messages=[SYSTEM, {"role": "user", "content": "x"}])))
        assert second.metrics.cached_tokens >= n_system - 10


def test_a_long_prompt_sharing_only_its_bos_is_prefilled_from_the_start(gemma3_path, isolated_dirs):
    long_text = " ".join(f"Line {i}: the river stones are smooth and grey." for i in range(30))
    with engine_for(gemma3_path, isolated_dirs, n_ctx=1024) as engine:
        engine.submit(ChatRequest(prompt="Hello", sampling=GREEDY, max_tokens=2)).result()
        warm = engine.submit(ChatRequest(prompt=long_text, sampling=GREEDY, max_tokens=8)).result()
        # the cache held the BOS; re-prefilling it keeps the big batch aligned (see Engine._start)
        assert warm.metrics.prompt_tokens > 300 and warm.metrics.cached_tokens == 0
        again = engine.submit(ChatRequest(prompt=long_text + " One more.", sampling=GREEDY, max_tokens=8)).result()
        # a long shared prefix is still reused
        assert again.metrics.cached_tokens > 300
    with engine_for(gemma3_path, isolated_dirs, n_ctx=1024) as engine:
        cold = engine.submit(ChatRequest(prompt=long_text, sampling=GREEDY, max_tokens=8)).result()
    assert warm.text == cold.text


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_quantized_kv_cache_still_answers(smollm2_path, isolated_dirs, kv_type):
    with engine_for(smollm2_path, isolated_dirs, kv_type=kv_type) as engine:
        done, _ = turn(engine, [], QUESTION, None)
        assert "Lutz" in done.text
        # the planner counts the smaller cache
        assert engine.plan.kv_cache < engine_for_plan_f16(engine)


def engine_for_plan_f16(engine):
    from edgechat.models import planner

    return planner.plan_for(engine.model_info, engine.n_ctx, engine.n_slots, "f16").kv_cache


def test_flash_attention_off_gives_the_same_greedy_answer(smollm2_path, isolated_dirs):
    answers = []
    for fa in ("auto", "off"):
        with engine_for(smollm2_path, isolated_dirs, flash_attn=fa) as engine:
            answers.append(turn(engine, [], QUESTION, None)[0].text)
    assert "Lutz" in answers[0] and answers[0] == answers[1]
