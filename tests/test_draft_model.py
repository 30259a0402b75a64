"""Speculative decoding with a draft model: the embedded Q4 models draft for their own Q8_0
(requantized here by llama.cpp), as a small quantization drafts for a big one. The text is the
model's own (greedy and seeded), the draft's cache follows the model's through rejections,
eviction, sessions and cancels, and a draft that does not fit is refused or left out in one line."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import GREEDY
from neartie import assert_same_or_near_tie
from serving import serving
from test_hub import CATALOG_NAME, edgechat, hub_cache, one_line_error  # noqa: F401 (hub_cache is a fixture)
from test_speculative import answer

from edgechat.engine import ChatRequest, Engine, EngineConfig, Evicted, SamplingParams
from edgechat.engine.runners.llama import LlamaBackend
from edgechat.engine.schedule.draft import DraftModel
from edgechat.errors import UsageError
from edgechat.models import catalog
from edgechat.models.planner import default_threads
from edgechat.server import ServerSettings, create_app
from quantize.requantize import requantize

PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at six. He polished the great lens, "
    "trimmed the wick and wrote the weather in a blue notebook."
)
PROMPTS = [
    f"Repeat this text exactly:\n\n{PASSAGE}",
    "Tell me a short story about a fox.",
    "用三句话介绍一下长城。",
]


@pytest.fixture(scope="module")
def q8(smollm2_path, gemma3_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("q8")
    return {
        name: requantize(src, out / f"{name}-Q8_0.gguf", "Q8_0", threads=default_threads())
        for name, src in (("smol", smollm2_path), ("gemma", gemma3_path))
    }


@pytest.fixture(scope="module")
def drafted(q8, smollm2_path, gemma3_path, models_root):
    engines = {}
    for name, draft in (("smol", smollm2_path), ("gemma", gemma3_path)):
        engines[name] = Engine(EngineConfig(model=str(q8[name]), draft_model=str(draft), n_ctx=1024, paths=models_root))
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.mark.parametrize("name", ["smol", "gemma"])
@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_text_is_the_same_with_a_draft_model(drafted, name, text):
    engine = drafted[name]
    plain, plain_calls = answer(engine, text, "off")
    for mode in ("draft", "auto"):
        fast, calls = answer(engine, text, mode)
        assert_same_or_near_tie(engine, [{"role": "user", "content": text}], plain.token_ids, fast.token_ids)
        assert fast.metrics.accepted_tokens <= fast.metrics.drafted_tokens
        if mode == "draft":
            # a Q4 of the same weights guesses most of its Q8's tokens: far fewer passes
            assert fast.metrics.drafted_tokens > 0 and calls < plain_calls, (calls, plain_calls, fast.metrics)
        assert engine.kv_problems() == []


def test_the_draft_reads_the_prompt_with_the_model(drafted):
    """Its first guess does not wait for it: a draft model that had to read the prompt
    mid-answer cost a probe of 2 tokens 20 decode steps."""
    engine = drafted["smol"]
    messages = [{"role": "user", "content": "Name three rivers of France, one per line."}]
    prompt = engine.prompt_tokens(ChatRequest(messages=messages))
    done = engine.submit(ChatRequest(messages=messages, sampling=GREEDY, max_tokens=1, speculative="auto")).result()
    assert done.metrics.drafted_tokens == 0  # one token: nothing was ever guessed
    assert prompt in [slot.tokens[: len(prompt)] for slot in engine.scheduler.draft.kv.slots]
    assert engine.kv_problems() == []


def test_seeded_sampling_is_the_same_with_a_draft_model(drafted):
    hot = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=5, repeat_penalty=1.1)
    engine = drafted["smol"]
    plain, _ = answer(engine, PROMPTS[1], "off", sampling=hot)
    fast, _ = answer(engine, PROMPTS[1], "draft", sampling=hot)
    assert fast.metrics.accepted_tokens > 0
    assert_same_or_near_tie(engine, [{"role": "user", "content": PROMPTS[1]}], plain.token_ids, fast.token_ids)


def test_the_drafts_cache_follows_through_eviction_sessions_and_cancel(q8, smollm2_path, isolated_dirs):
    cfg = EngineConfig(model=str(q8["smol"]), draft_model=str(smollm2_path), n_ctx=256, paths=isolated_dirs, speculative="draft")
    with Engine(cfg) as engine:
        first = [{"role": "user", "content": PROMPTS[0]}]
        long = engine.submit(ChatRequest(messages=first, sampling=GREEDY, max_tokens=400, ignore_eos=True, session="s")).result()
        # the answer outgrew the 256-token context: older tokens were shifted out of both caches
        assert long.reason == "length" and long.metrics.accepted_tokens > 0
        assert engine.kv_problems() == []
        again = first + [{"role": "assistant", "content": long.text}, {"role": "user", "content": "Say it again."}]
        engine.submit(ChatRequest(messages=again, sampling=GREEDY, max_tokens=40, session="s")).result()
        assert engine.kv_problems() == []
        handle = engine.submit(ChatRequest(messages=first, sampling=GREEDY, max_tokens=200, ignore_eos=True))
        for _ in handle.events():
            handle.cancel()
        assert handle.finished.reason == "cancelled"
        assert engine.kv_problems() == []
        # the next request on that sequence starts from what the draft held: still the model's text
        plain = engine.submit(ChatRequest(messages=first, sampling=GREEDY, max_tokens=40, speculative="off")).result()
        fast = engine.submit(ChatRequest(messages=first, sampling=GREEDY, max_tokens=40)).result()
        assert_same_or_near_tie(engine, first, plain.token_ids, fast.token_ids)
        assert engine.kv_problems() == []


def test_the_drafts_own_kv_manager_sees_its_cells_after_rejections_and_a_shift(q8, smollm2_path, isolated_dirs, monkeypatch):
    """The draft's cache has its own KV manager, and kv_problems runs its check: clean after
    rejected guesses and an eviction shift mid-answer (applied to the draft by a shift, not a
    recompute), and failing for a cell removed behind the manager's back."""
    cfg = EngineConfig(model=str(q8["smol"]), draft_model=str(smollm2_path), n_ctx=256, paths=isolated_dirs, speculative="draft")
    with Engine(cfg) as engine:
        draft = engine.scheduler.draft
        shifts = []
        real_add = draft.runner.seq_add
        monkeypatch.setattr(draft.runner, "seq_add", lambda *a: (shifts.append(a), real_add(*a))[1])
        # sampled at temperature 1: the draft's greedy guesses are often rejected (greedy, this
        # Q4 and its Q8 agree on every token the draft is sure of)
        handle = engine.submit(ChatRequest(messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=400,
                                           sampling=SamplingParams(temperature=1.0, seed=7), ignore_eos=True))
        events = list(handle)
        done = handle.finished
        assert done.reason == "length" and any(isinstance(e, Evicted) for e in events)
        assert done.metrics.drafted_tokens > done.metrics.accepted_tokens > 0  # some guesses were rejected
        assert shifts  # the eviction moved the draft's cells too
        assert draft.kv.check() == [] and engine.kv_problems() == []
        slot = max(draft.kv.slots, key=lambda s: len(s.tokens))
        held = engine.kv.slots[slot.seq].tokens
        # it followed the answer past the shifts: what the model's sequence holds, but for the last few
        assert len(slot.tokens) > len(held) - 8 and slot.tokens == held[: len(slot.tokens)]
        draft.runner.seq_rm(slot.seq, 100, 101)  # a hole the mirror does not know of
        problems = engine.kv_problems()
        assert problems and all(p.startswith(f"draft seq {slot.seq}:") for p in problems), problems


def test_the_draft_follows_rejections_and_shifts_through_its_kv_manager(smollm2_path):
    """On the draft model alone: a rejected guess leaves no cell behind, a shift keeps what
    follows the cut at its new positions, and the check reads llama.cpp's cells."""
    target = LlamaBackend(smollm2_path, n_ctx_total=512, n_seq_max=2, n_threads=default_threads())
    draft = DraftModel(smollm2_path, target, n_ctx=256, n_threads=default_threads())
    try:
        # a passage told three times and begun again: the draft is sure how it goes on
        tokens = target.tokenize("\n".join([PASSAGE] * 3 + [PASSAGE[:62]]), add_bos=True)
        guess = draft.propose(0, tokens, 4)
        held = draft.kv.slots[0].tokens
        assert len(held) > len(tokens) and held == tokens + guess[: len(held) - len(tokens)]  # guesses in its cells
        other = next(t for t in range(100, 200) if t != guess[0])
        taken = tokens + [other]  # the target rejected every guess
        assert draft.behind(0, taken) == 1
        draft.follow(0, taken)
        assert draft.kv.slots[0].tokens == taken and draft.problems() == []
        draft.drop(0, 5, 15)
        assert draft.kv.slots[0].tokens == taken[:5] + taken[15:] and draft.problems() == []
        # a cut past what it holds forgets from the cut on; the next guess decodes it again
        draft.drop(0, 20, len(taken) + 3)
        assert draft.kv.slots[0].tokens == (taken[:5] + taken[15:])[:20] and draft.problems() == []
        assert draft.kv.slots[1].tokens == [] and draft.runner.seq_pos_range(1) == (-1, -1)
        draft.runner.seq_add(0, 10, -1, 2)  # moved behind the manager's back
        assert draft.problems() and draft.problems()[0].startswith("draft seq 0:")
    finally:
        draft.close()
        target.close()


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(smollm2_path, gemma3_path, models_root):
    with pytest.raises(UsageError, match=r"draft model .*gguf.*same family") as err:
        Engine(EngineConfig(model=str(smollm2_path), draft_model=str(gemma3_path), n_ctx=256, paths=models_root))
    assert "\n" not in str(err.value)


def test_a_draft_that_does_not_load_leaves_the_model_serving(smollm2_path, tmp_path, models_root):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with Engine(EngineConfig(model=str(smollm2_path), draft_model=str(broken), n_ctx=256, paths=models_root)) as engine:
        assert engine.draft is None and "draft model not used" in engine.draft_warning
        done, _ = answer(engine, PROMPTS[0], "auto")
        assert done.reason in ("stop", "length") and done.text
    with Engine(EngineConfig(model=str(smollm2_path), n_ctx=256, paths=models_root)) as engine:
        with pytest.raises(UsageError, match="needs a draft model"):
            engine.submit(ChatRequest(messages=[{"role": "user", "content": "hi"}], speculative="draft"))


@pytest.mark.usefixtures("hub_cache")
def test_the_catalog_names_a_draft_used_when_it_is_here(isolated_dirs):
    # the catalog's SmolLM2 360M (faked by the 135M's file) names the embedded 135M as its draft
    with Engine(EngineConfig(model=CATALOG_NAME, n_ctx=256, paths=isolated_dirs)) as engine:
        assert engine.draft_ref == "smollm2-135m-instruct" and engine.draft is not None
        done, _ = answer(engine, PROMPTS[0], "draft")
        assert done.metrics.accepted_tokens > 0
    with Engine(EngineConfig(model=CATALOG_NAME, n_ctx=256, paths=isolated_dirs, speculative="off")) as engine:
        assert engine.draft is None
    bad = {"schema": 1, "model": [{"name": "a", "repo": "o/r", "architecture": "llama", "licence": "mit", "context": 4096,
                                   "description": "x", "draft": "nope", "files": {"Q4_K_M": {"file": "a-Q4_K_M.gguf", "size": 10}}}]}
    with pytest.raises(ValueError, match="draft 'nope' is not a catalog or embedded model"):
        catalog.parse_catalog(bad)


def test_run_takes_a_draft_model_and_reports_acceptance(q8, smollm2_path, gemma3_path):
    common = ["run", "-m", str(q8["smol"]), "--draft-model", str(smollm2_path), "--ctx", "512", "--temperature", "0"]
    proc = edgechat(*common, "--speculative", "draft", "--max-tokens", "30", "--json", PROMPTS[0])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["drafted_tokens"] >= out["accepted_tokens"] > 0
    proc = edgechat("run", "-m", str(smollm2_path), "--draft-model", str(gemma3_path), "--ctx", "256", "hi")
    assert proc.returncode != 0 and one_line_error(proc).startswith("edgechat: error: draft model"), proc.stderr


def test_serve_drafts_per_request_and_counts_it(drafted):
    engine = drafted["smol"]
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0, "max_tokens": 40}
    with serving(create_app(ServerSettings(model_id="m", degrade_queue_wait=None), engine)) as url:
        plain = httpx.post(f"{url}/v1/chat/completions", json={**body, "speculative": "off"}, timeout=120).json()
        fast = httpx.post(f"{url}/v1/chat/completions", json={**body, "speculative": "draft"}, timeout=120).json()
        assert fast["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        metrics = httpx.get(f"{url}/metrics").text
        accepted = [line for line in metrics.splitlines() if line.startswith("edgechat_draft_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0, accepted
        bad = httpx.post(f"{url}/v1/chat/completions", json={**body, "speculative": "fast"}, timeout=30)
        assert bad.status_code == 400 and "draft" in bad.json()["error"]["message"]
