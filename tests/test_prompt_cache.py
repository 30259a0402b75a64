"""The prompt cache (host RAM) on the real SmolLM2: more distinct prompts than sequences, sent
twice; the second pass restores each prompt's state instead of prefilling it, answers as a cold
run does, keeps the KV mirrors true to llama.cpp, stays within its byte budget, and never
restores a state made for another context or one llama.cpp refuses."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from click.testing import CliRunner
from neartie import assert_same_tokens_or_near_tie
from serving import serving

from edgechat.cli import cli
from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams
from edgechat.engine.kv.prefix import common_prefix
from edgechat.engine.kv.promptcache import PromptCache
from edgechat.server import ServerSettings, create_app

MODEL = "smollm2-135m-instruct"
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in one short paragraph."}
TOPICS = ["a lighthouse keeper", "a copper kettle", "the winter market", "a paper boat", "an old violin", "the night train"]
#: distinct prompts of ~80 tokens that share the system prompt (as an agent's calls do)
PROMPTS = [
    [SYSTEM, {"role": "user", "content": f"Write two sentences about {topic}. Mention the weather, a colour and a sound, and end with a question about {topic}."}]
    for topic in TOPICS
]
ANSWER_TOKENS = 8


def engine_for(paths, budget: int, n_parallel: int = 2, n_ctx: int = 512) -> Engine:
    return Engine(
        EngineConfig(model=MODEL, n_ctx=n_ctx, n_parallel=n_parallel, paths=paths, prompt_cache_budget=budget, speculative="off")
    )


def request(messages: list[dict]) -> ChatRequest:
    # every answer runs to ANSWER_TOKENS, so each cached state holds the same number of tokens
    return ChatRequest(messages=messages, sampling=SamplingParams(temperature=0), max_tokens=ANSWER_TOKENS, ignore_eos=True)


def ask_all(engine: Engine, prompts: list[list[dict]]):
    """Submit them together (more than there are sequences) and wait for every answer."""
    handles = [engine.submit(request(p)) for p in prompts]
    return [h.result(timeout=300) for h in handles]


def test_a_second_pass_restores_every_prompt_and_answers_as_a_cold_run(isolated_dirs):
    with engine_for(isolated_dirs, 64 << 20) as engine:
        ask_all(engine, PROMPTS)
        # 6 prompts through 2 sequences: each one taken over was kept in RAM (the last two on
        # the next pass's admission)
        assert len(engine.prompt_cache) == len(PROMPTS) - 2
        second = ask_all(engine, PROMPTS)
        assert engine.kv_problems() == []
        for done in second:
            m = done.metrics
            assert m.prompt_cache_hit is True, m
            # the whole prompt: the logits after it were kept with its state
            assert m.restored_tokens == m.cached_tokens == m.prompt_tokens
        assert engine.stats()["prompt_cache_bytes"] <= 64 << 20
        for messages, done in zip(PROMPTS, second, strict=True):
            prompt = engine.prompt_tokens(ChatRequest(messages=messages))
            cold = engine.greedy_continuation(ANSWER_TOKENS, tokens=prompt)
            assert_same_tokens_or_near_tie(engine, prompt, cold, done.token_ids)
        assert engine.kv_problems() == []


@pytest.mark.parametrize("held_in", ["sequence", "prompt cache"])
def test_the_same_prompt_again_needs_no_decode_before_its_first_token(isolated_dirs, held_in):
    """A prompt sent again (a retry, a regenerate, an agent's repeated call) whose whole prompt is
    held, in its sequence or in the prompt cache, starts from the logits kept after it: its
    first token comes without a llama_decode (llama-server decodes the last prompt token again),
    and the answer is a cold run's."""
    with engine_for(isolated_dirs, 64 << 20, n_parallel=1) as engine:
        ask_all(engine, PROMPTS[:1] if held_in == "sequence" else PROMPTS[:2])
        prompt = engine.prompt_tokens(ChatRequest(messages=PROMPTS[0]))
        before = engine.stats()["decode_calls"]
        one = engine.submit(ChatRequest(messages=PROMPTS[0], sampling=SamplingParams(temperature=0), max_tokens=1)).result(timeout=300)
        assert engine.stats()["decode_calls"] == before
        assert one.metrics.cached_tokens == len(prompt)
        assert one.metrics.prompt_cache_hit is (held_in == "prompt cache")
        (done,) = ask_all(engine, PROMPTS[:1])
        assert done.token_ids[:1] == one.token_ids
        assert engine.kv_problems() == []
        cold = engine.greedy_continuation(ANSWER_TOKENS, tokens=prompt)
        assert_same_tokens_or_near_tie(engine, prompt, cold, done.token_ids)


def test_a_sampled_first_token_from_kept_logits_is_the_one_a_decode_gives(isolated_dirs):
    """The kept logits go through the request's own sampler chain as llama_sampler_sample takes
    a context's: with the same seed, the same tokens and log probabilities as when the prompt's
    last token was decoded."""
    req = lambda: ChatRequest(messages=PROMPTS[3], sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7),
                              max_tokens=ANSWER_TOKENS, ignore_eos=True, logprobs=3)
    with engine_for(isolated_dirs, 64 << 20, n_parallel=1) as engine:
        decoded = engine.submit(req()).result(timeout=300)
        kept = engine.submit(req()).result(timeout=300)
        assert kept.metrics.cached_tokens == kept.metrics.prompt_tokens > decoded.metrics.cached_tokens
        assert kept.token_ids == decoded.token_ids
        for a, b in zip(decoded.logprobs, kept.logprobs, strict=True):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-3
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_prompt_a_few_tokens_past_what_the_slots_hold_is_restored(isolated_dirs):
    """Short agent calls differ from each other by a few tokens after a shared system prompt:
    loading a state costs under 2 ms, prefilling even 4 tokens more (measured on SmolLM2), so
    such a prompt is restored too, not prefilled."""
    short = [[SYSTEM, {"role": "user", "content": text}] for text in ("Say hi.", "Count to three.")]
    with engine_for(isolated_dirs, 64 << 20, n_parallel=1) as engine:
        ask_all(engine, short)
        prompt = engine.prompt_tokens(ChatRequest(messages=short[0]))
        held = common_prefix(engine.kv.slots[0].tokens, prompt)
        assert 2 <= len(prompt) - held < 16, (len(prompt), held)
        (done,) = ask_all(engine, short[:1])
        assert done.metrics.prompt_cache_hit is True, done.metrics
        assert done.metrics.cached_tokens == len(prompt)
        cold = engine.greedy_continuation(ANSWER_TOKENS, tokens=prompt)
        assert_same_tokens_or_near_tie(engine, prompt, cold, done.token_ids)
        assert engine.kv_problems() == []


def test_the_budget_keeps_the_most_recently_used_states(isolated_dirs):
    with engine_for(isolated_dirs, 64 << 20, n_parallel=1) as engine:
        ask_all(engine, PROMPTS[:2])
        (entry,) = engine.prompt_cache.entries()
        size = entry.nbytes
        # room for two states of this size, not three
        engine.prompt_cache.budget = budget = int(size * 2.5)
        ask_all(engine, PROMPTS[2:])
        assert engine.stats()["prompt_cache_bytes"] <= budget
        # one sequence: prompts 0..4 were stashed in turn as the next took it; 3 and 4 remain
        kept = [e.tokens for e in engine.prompt_cache.entries()]
        prompts = [engine.prompt_tokens(ChatRequest(messages=p)) for p in PROMPTS]
        assert [next(i for i, p in enumerate(prompts) if t[: len(p)] == p) for t in kept] == [3, 4]
        results = [engine.submit(request(PROMPTS[i])).result(timeout=300) for i in (4, 0, 3)]
        assert [r.metrics.prompt_cache_hit for r in results] == [True, False, False]
        assert engine.stats()["prompt_cache_bytes"] <= budget
        assert engine.kv_problems() == []


def test_a_state_for_another_context_or_one_llama_cpp_refuses_is_never_restored(isolated_dirs):
    with engine_for(isolated_dirs, 64 << 20, n_parallel=1) as engine:
        first = ask_all(engine, PROMPTS[:4])
        foreign, truncated, too_long = engine.prompt_cache.entries()
        foreign.tags = {**foreign.tags, "n_ctx": engine.n_ctx * 2}  # saved by an engine of another context size
        truncated.data = truncated.data[: len(truncated.data) // 2]  # cut short
        too_long.tokens = too_long.tokens + too_long.tokens[-3:]  # claims cells it does not hold
        again = [engine.submit(request(p)).result(timeout=300) for p in PROMPTS[:3]]
        assert [r.metrics.prompt_cache_hit for r in again] == [False] * 3
        prompts = [engine.prompt_tokens(ChatRequest(messages=p)) for p in PROMPTS]
        shared = max(common_prefix(prompts[0], p) for p in prompts[1:])  # the system prompt and more
        assert all(r.metrics.cached_tokens <= shared for r in again)  # the rest was prefilled
        assert engine.kv_problems() == []
        assert not any(e is bad for e in engine.prompt_cache.entries() for bad in (foreign, truncated, too_long))
        for messages, before, after in zip(PROMPTS, first, again, strict=False):  # the three asked again
            assert_same_tokens_or_near_tie(engine, engine.prompt_tokens(ChatRequest(messages=messages)), before.token_ids, after.token_ids)


def test_serve_counts_hits_misses_restored_tokens_and_bytes(isolated_dirs):
    engine = engine_for(isolated_dirs, 64 << 20)
    settings = ServerSettings(model_id=MODEL, degrade_queue_wait=None)
    body = lambda messages: {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    try:
        with serving(create_app(settings, engine)) as url, concurrent.futures.ThreadPoolExecutor(4) as pool:
            for _ in range(2):
                codes = pool.map(lambda m: httpx.post(f"{url}/v1/chat/completions", json=body(m), timeout=300).status_code, PROMPTS)
                assert list(codes) == [200] * len(PROMPTS)
            text = httpx.get(f"{url}/metrics").text
        prompts = [engine.prompt_tokens(ChatRequest(messages=p)) for p in PROMPTS]
    finally:
        engine.close()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("edgechat_prompt_cache")}
    assert values["edgechat_prompt_cache_hits_total"] == len(PROMPTS)
    assert values["edgechat_prompt_cache_misses_total"] == len(PROMPTS)
    assert values["edgechat_prompt_cache_restored_tokens_total"] == sum(len(p) for p in prompts)
    assert 0 < values["edgechat_prompt_cache_bytes"] <= 64 << 20
    # one state per prompt, and a second where a second answer parted from the first (a near-tie
    # decided otherwise in another batch)
    assert len(PROMPTS) <= values["edgechat_prompt_cache_entries"] <= 2 * len(PROMPTS)


def test_entries_are_kept_by_prefix_and_evicted_by_bytes():
    """The cache alone: a longer state of the same tokens replaces the shorter, a state larger
    than the budget is not kept, and the least recently used go first."""
    cache = PromptCache(100, lambda: {"model": "m"})
    cache.put([1, 2, 3], b"x" * 30)
    cache.put([1, 2, 3, 4, 5], b"x" * 40)  # extends the first: it replaces it
    assert [e.tokens for e in cache.entries()] == [[1, 2, 3, 4, 5]]
    assert cache.covers([1, 2, 3]) and not cache.covers([1, 2, 4])
    cache.put([7, 8], b"x" * 40)
    entry, n = cache.longest([1, 2, 3, 9])
    assert (entry.tokens, n) == ([1, 2, 3, 4, 5], 3)
    cache.touch(entry)
    cache.put([9], b"x" * 40)  # over budget: [7, 8] is the least recently used
    assert [e.tokens for e in cache.entries()] == [[1, 2, 3, 4, 5], [9]] and cache.bytes == 80
    cache.put([10], b"x" * 101)
    assert len(cache) == 2
    assert PromptCache(0, dict).enabled is False


def test_serve_passes_cache_ram_in_mib_to_the_engine(monkeypatch):
    import edgechat.engine

    seen = []

    class Stop(Exception):
        pass

    def record(config):
        seen.append(config.prompt_cache_budget)
        raise Stop  # the configuration is all this test needs: no model is loaded

    monkeypatch.setattr(edgechat.engine, "open_engine", record)
    for i, (args, budget) in enumerate((([], 256 << 20), (["--cache-ram", "0"], 0), (["--cache-ram", "64"], 64 << 20))):
        result = CliRunner().invoke(cli, ["serve", *args])
        # the model pool reports the stopped load as a load failure; the engine saw the setting
        assert result.exit_code != 0 and len(seen) == i + 1 and seen[-1] == budget
    result = CliRunner().invoke(cli, ["serve", "--cache-ram", "-1"])
    assert result.exit_code == 2 and "--cache-ram" in result.output


def test_gemma_states_restore_within_the_sliding_window(isolated_dirs):
    """Gemma 3's sliding layers: a sequence state holds only their last window (512) of cells, so
    a state longer than that could not be cut back to a prompt; it is never used, while shorter
    ones are."""
    long = [{"role": "user", "content": "Tell me a story. " + "The river runs past the mill and the old bridge. " * 45}]
    prompts = [*PROMPTS[:2], long]
    config = EngineConfig(model="gemma3-270m", n_ctx=1024, n_parallel=1, paths=isolated_dirs, prompt_cache_budget=64 << 20, speculative="off")
    with Engine(config) as engine:
        assert engine.plan.swa_full
        first = [engine.submit(request(p)).result(timeout=300) for p in prompts]
        second = [engine.submit(request(p)).result(timeout=300) for p in prompts]
        assert first[2].metrics.prompt_tokens + ANSWER_TOKENS > 512
        assert [r.metrics.prompt_cache_hit for r in second] == [True, True, False]
        assert engine.kv_problems() == []
        for messages, before, after in zip(prompts, first, second, strict=True):
            prompt = engine.prompt_tokens(ChatRequest(messages=messages))
            assert_same_tokens_or_near_tie(engine, prompt, before.token_ids, after.token_ids)
