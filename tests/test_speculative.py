"""Speculative decoding: the drafter and the cost policy alone, then on the real models: the same
text as plain decoding (greedy and seeded sampling), fewer passes on grounded work, and a KV
cache that stays consistent through rejected drafts, eviction mid-answer, sessions and cancels."""

from __future__ import annotations

import pytest
from conftest import GREEDY
from neartie import assert_same_or_near_tie

from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams
from edgechat.engine.schedule.speculative import DraftPolicy, NgramDrafter, StepCost
from edgechat.errors import UsageError

PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at six. He polished the great lens, "
    "trimmed the wick and wrote the weather in a blue notebook. Ships passed far out at sea, and "
    "none of them ever knew his name, but each of them found the harbour by his light."
)
REWRITE = f"Repeat this text exactly, word for word:\n\n{PASSAGE}"
ZH = "请把下面这段话原样重复一遍：\n\n小猫每天早上坐在窗台上看鸟。它从来不去抓它们，只是安静地看着，然后回到厨房吃早饭。"


# ---------------------------------------------------------------- without a model
def test_ngram_drafter_proposes_what_followed_the_longest_recent_match():
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7])
    assert d.propose(3) == []  # 6 7 never occurred before
    d.extend([2, 3, 4])
    assert d.propose(2) == [6, 7]  # the latest earlier 2 3 4 was followed by 6 7
    d.extend([1, 2])
    assert d.propose(4) == [3, 4, 5, 9]  # the 4-gram 4 1 2 is new, the 2-gram 1 2 was followed by 3 4 5 9


def measured(*steps: tuple[int, float]) -> StepCost:
    """A StepCost that has seen each (size, seconds) often enough to trust it."""
    cost = StepCost()
    for n, seconds in steps:
        for _ in range(StepCost.TRUSTED):
            cost.observe(n, seconds)
    return cost


def test_step_cost_interpolates_and_starts_from_a_prior():
    cost = StepCost()
    assert cost.ratio(1, 4) == pytest.approx(2.0)
    cost = measured((1, 0.010), (9, 0.018))
    assert cost.ratio(1, 4) == pytest.approx(0.014 / 0.010)
    cost.observe(600, 2.0)  # a prefill chunk: compute-bound, says nothing of a decode step's cost
    assert cost.ratio(9, 4) == pytest.approx(1 + 0.25 * 4 / (1 + 0.25 * 8))
    assert cost.ratio(1, 0) == 1.0


def test_a_stalled_step_does_not_turn_drafting_off():
    """Another process took the CPU for one step (measured here: a step 40-120x its usual time
    while tests ran next door): before, that size's cost jumped to the stall, the policy never
    drafted that many again, so never measured it again, and stayed short or off for good."""
    cost = measured(*((n, 0.010 * (1 + 0.3 * (n - 1))) for n in (1, 2, 3, 5, 9, 17)))
    policy = DraftPolicy()
    policy.first = policy.follow = 0.98  # a copied run: nearly every guess kept
    before = policy.length(cost, 1, 1, 16)
    assert before >= 8
    cost.observe(before + 1, 1.2)  # one stall on the size the policy drafts
    assert cost.ratio(1, before) == pytest.approx(1 + 0.3 * before)
    assert policy.length(cost, 1, 1, 16) == before
    cost.observe(13, 0.9)  # a size seen once, stalled: its neighbours estimate it until it is known
    assert cost.ratio(1, 12) == pytest.approx(1 + 0.3 * 12)
    for _ in range(StepCost.WINDOW):  # a size that really got slower is believed, and avoided
        cost.observe(before + 1, 1.2)
    assert cost.ratio(1, before) > 100 and policy.length(cost, 1, 1, 16) != before


def test_a_copy_that_ends_mid_draft_keeps_the_next_draft_long():
    """Grounded text: drafts are copies of a passage, kept whole until the answer leaves it."""
    cost = measured(*((n, 0.010 * (1 + 0.3 * (n - 1))) for n in (1, 2, 3, 5, 9, 17)))
    policy = DraftPolicy()
    for _ in range(12):
        k = policy.length(cost, 1, 1, 16)
        policy.update(k, k)
    before = policy.length(cost, 1, 1, 16)
    assert before >= 8, (policy.first, policy.follow)
    policy.update(before, before // 2)  # the answer left the passage halfway through the draft
    # one token missed after a run of kept ones, not a rate of 1/2: the next draft stays useful
    assert policy.follow > 0.85 and policy.length(cost, 1, 1, 16) >= 4
    follow = policy.follow
    policy.update(8, 0)  # a guess from the wrong passage: its first token is wrong
    assert policy.follow == follow and policy.first < 0.9


def test_draft_policy_drafts_when_it_pays_and_backs_off_when_it_misses():
    cost = measured((1, 0.010), (9, 0.040))  # a wide batch is 4x a single token: only a good guess pays
    policy = DraftPolicy()
    policy.first = policy.follow = 0.95
    assert policy.length(cost, 1, 1, 8) >= 4
    policy.first = policy.follow = 0.1
    assert policy.length(cost, 1, 1, 8) == 0
    policy.first = policy.follow = 0.9
    policy.update(4, 0)  # a miss: skip the next step, then two, ...
    assert policy.length(cost, 1, 1, 8) == 0 and policy.length(cost, 1, 1, 8) > 0
    assert (policy.drafted, policy.accepted) == (4, 0)
    # a guess right 60% of the time pays for one sequence alone (a token more costs 5%), but not
    # in a step of four where every sequence waits for the wider batch (a token more costs 17%)
    costs = measured((1, 0.009), (2, 0.0095), (4, 0.024), (5, 0.028))
    fair = DraftPolicy()
    fair.first = fair.follow = 0.6
    assert fair.length(costs, 4, 4, 8) == 0
    assert fair.length(costs, 1, 1, 1) == 1
    assert DraftPolicy(forced=True).length(cost, 1, 1, 5) == 5
    # forced: always a draft, of the length that pays best if all is kept (Gemma 3's measured steps)
    gemma = measured((1, 0.0135), (16, 0.077), (15, 0.089), (17, 0.095))
    assert DraftPolicy(forced=True).length(gemma, 1, 1, 16) == 15
    assert DraftPolicy(forced=True).length(gemma, 1, 1, 3) == 3
    # steps where the drafter has nothing to offer do not use up (and so postpone) the probes
    idle = DraftPolicy()
    idle.first = idle.follow = 0.1
    for _ in range(20):
        assert idle.length(cost, 1, 1, 0) == 0
    assert [idle.length(cost, 1, 1, 8) for _ in range(4)] == [0, 0, 0, DraftPolicy.PROBE]



def test_a_draft_starts_only_where_it_is_expected_to_gain_a_tenth():
    """The rates are estimates (optimistic at a request's start): a draft expected to gain 7%
    lost on SmolLM2's code and open tasks (0.91-0.96x of plain), so drafting starts at 10%."""
    cost = measured((1, 0.010), (2, 0.015))  # a token more costs half a step
    policy = DraftPolicy()
    policy.first, policy.follow = 0.6, 0.1  # one token, expected to gain (1 + 0.6) / 1.5 = 1.07
    assert policy.length(cost, 1, 1, 4) == 0
    policy.first = 0.8  # 1.2
    assert policy.length(cost, 1, 1, 4) == 1

def test_no_probe_where_even_the_probe_kept_whole_would_not_pay():
    """A draft model as slow as the model itself (SmolLM2's Q4_K_M guessing for its F16 on 2
    cores: 8.0 ms a guess against 8.9 ms a step, and 2 tokens cost 2.1 steps) never pays, so
    auto must not spend steps asking whether it would; a cheap drafter is still probed."""
    f16 = measured((1, 0.0089), (2, 0.0186), (3, 0.0211), (5, 0.0238), (9, 0.0323), (17, 0.0492))
    slow = DraftPolicy()
    slow.first = slow.follow = 0.1
    assert [slow.length(f16, 1, 1, 16, draft_cost=0.9) for _ in range(200)] == [0] * 200
    cheap = DraftPolicy()
    cheap.first = cheap.follow = 0.1
    assert DraftPolicy.PROBE in [cheap.length(f16, 1, 1, 16, draft_cost=0.05) for _ in range(8)]
    # a cheap draft model that must first catch up on 150 tokens: 20 steps before any guess
    behind = DraftPolicy()
    behind.first = behind.follow = 0.1
    assert [behind.length(f16, 1, 1, 16, draft_cost=0.05, setup=20) for _ in range(200)] == [0] * 200
    # a server's step of 4 sequences (SmolLM2, measured): a probe of 2 would make all 4 wait 37%
    # longer for at most 2 tokens more; the same probe for one sequence alone is worth asking
    server = measured((1, 0.0092), (3, 0.0229), (4, 0.0244), (6, 0.0335))
    wide = DraftPolicy()
    wide.first = wide.follow = 0.1
    assert [wide.length(server, 4, 4, 16) for _ in range(200)] == [0] * 200
    assert DraftPolicy.PROBE in [wide.length(server, 1, 1, 16) for _ in range(8)]

# ---------------------------------------------------------------- on the real models
def answer(engine, text, mode, **kw):
    kw.setdefault("sampling", GREEDY)
    kw.setdefault("max_tokens", 80)
    before = engine.stats()["decode_calls"]
    done = engine.submit(ChatRequest(messages=[{"role": "user", "content": text}], speculative=mode, **kw)).result()
    return done, engine.stats()["decode_calls"] - before


@pytest.mark.parametrize("name", ["smol", "gemma"])
@pytest.mark.parametrize("text", [REWRITE, ZH, "Tell me a short story about a fox."])
def test_greedy_text_is_the_same_with_speculation(request, name, text):
    engine = request.getfixturevalue(name)
    plain, plain_calls = answer(engine, text, "off")
    for mode in ("lookup", "auto"):
        fast, calls = answer(engine, text, mode)
        assert_same_or_near_tie(engine, [{"role": "user", "content": text}], plain.token_ids, fast.token_ids)
        assert fast.metrics.accepted_tokens <= fast.metrics.drafted_tokens
        assert calls <= plain_calls
        assert engine.kv_problems() == []


def test_grounded_text_takes_fewer_passes(smol):
    plain, plain_calls = answer(smol, REWRITE, "off", max_tokens=60, ignore_eos=True)
    fast, calls = answer(smol, REWRITE, "lookup", max_tokens=60, ignore_eos=True)
    assert fast.token_ids == plain.token_ids
    assert fast.metrics.accepted_tokens > 20 and calls < plain_calls * 0.7, (calls, plain_calls, fast.metrics)


def test_seeded_sampling_is_the_same_with_speculation(smol):
    hot = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11, repeat_penalty=1.1)
    plain, _ = answer(smol, REWRITE, "off", sampling=hot, max_tokens=60)
    fast, _ = answer(smol, REWRITE, "lookup", sampling=hot, max_tokens=60)
    assert fast.metrics.drafted_tokens > 0
    assert fast.token_ids == plain.token_ids


def test_rejected_drafts_leave_the_cache_consistent_through_eviction_sessions_and_cancel(smollm2_path, isolated_dirs):
    with Engine(EngineConfig(model=str(smollm2_path), n_ctx=256, paths=isolated_dirs, speculative="lookup")) as engine:
        long = engine.submit(ChatRequest(messages=[{"role": "user", "content": REWRITE}], sampling=GREEDY,
                                         max_tokens=500, ignore_eos=True, session="s")).result()
        assert long.reason == "length" and long.metrics.drafted_tokens > long.metrics.accepted_tokens > 0
        assert engine.kv_problems() == []
        handle = engine.submit(ChatRequest(messages=[{"role": "user", "content": REWRITE}], sampling=GREEDY,
                                           max_tokens=300, ignore_eos=True))
        for _ in handle.events():
            handle.cancel()
        assert handle.finished.reason == "cancelled"
        assert engine.kv_problems() == []


def test_a_bad_mode_is_one_clear_line(smol):
    with pytest.raises(UsageError, match="auto, off, lookup or draft"):
        smol.submit(ChatRequest(messages=[{"role": "user", "content": "hi"}], speculative="fast"))
