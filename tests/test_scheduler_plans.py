"""The scheduler's plans and updates, driven through a scripted runner (tests/fake_runner.py):
admission, chunked prefill, drafts and finishes without a model. What this cannot prove is
anything about a real model's numbers: the real runners are tested on the real models in
test_engine.py, test_speculative.py and test_onnx_runner.py."""

from __future__ import annotations

import pytest

from edgechat.engine.kv.kvcache import KVManager
from edgechat.engine.kv.promptcache import PromptCache
from edgechat.engine.kv.sessions import ConversationStates
from edgechat.engine.prompt.prompt import Prepared
from edgechat.engine.schedule.running import Phase, Running
from edgechat.engine.schedule.scheduler import PREFILL_CHUNK_BUSY, Scheduler
from edgechat.engine.types.metrics import RequestClock
from edgechat.engine.types.request import ChatRequest, ContextPolicy, Finished, RequestHandle, TextDelta
from edgechat.params import SamplingParams, SpeculativeMode
from tests.fake_runner import EOS, FakeRunner, cycle, text_of, tokens_of


def make(n_parallel=1, speculative=SpeculativeMode.OFF, script=cycle, n_ctx=4096, prefill_chunk=PREFILL_CHUNK_BUSY):
    runner = FakeRunner(n_parallel, script=script)

    kv = KVManager(runner, n_parallel, prompt_cache=PromptCache(0, dict))  # no conversation here is snapshotted
    sched = Scheduler(runner, kv, ConversationStates(), n_ctx, n_parallel,
                      lambda r: ContextPolicy(r.context_policy), lambda r: speculative, prefill_chunk=prefill_chunk)
    return sched, runner


def submit(sched, prompt: list[int], **kw) -> tuple[RequestHandle, Running]:
    req = ChatRequest(prompt="-", sampling=SamplingParams(temperature=0), **kw)
    handle = RequestHandle(req)
    run = Running(handle, req, Prepared(list(prompt), 0, (), 0, 0), RequestClock())
    sched.reserve(None)
    sched.waiting.append(run)
    return handle, run


def drive(sched, steps=10_000):
    while sched.active or sched.waiting:
        sched.admit()
        sched.step()
        steps -= 1
        assert steps, "the scheduler made no progress"


def finished(handle) -> Finished:
    assert handle.finished is not None, "the request never ended"
    return handle.finished


def test_a_plan_holds_what_each_phase_puts_in_and_update_samples_it():
    sched, runner = make()
    handle, run = submit(sched, tokens_of("abc"), max_tokens=4)
    sched.admit()
    assert run.phase is Phase.PREFILLING
    plan = sched.schedule()
    assert plan.prompted == [run] and plan.decoding == [] and plan.batch.n == 3
    assert run.phase is Phase.SAMPLING  # its prompt's last token is in this step
    assert runner.runs == []  # planning ran nothing
    runner.decode(plan.batch)
    sched.update(plan)
    assert run.phase is Phase.DECODING and run.next_token == tokens_of("d")[0]
    assert run.slot.next_logits is not None and run.slot.next_logits.n == 3  # kept for a resend
    drive(sched)
    done = finished(handle)
    assert done.text == "defg" and done.reason == "length" and run.phase is Phase.FINISHED
    assert sched.kv.check() == []


def test_admission_waits_for_a_free_sequence_and_decodes_the_running_ones_together():
    sched, runner = make(n_parallel=2)
    handles = [submit(sched, tokens_of(p), max_tokens=3)[0] for p in ("ab", "fg", "kl")]
    sched.admit()
    assert len(sched.active) == 2 and len(sched.waiting) == 1 and sched.n_waiting == 1
    drive(sched)
    assert [finished(h).text for h in handles] == ["cde", "hij", "mno"]
    # the two first requests' prompts in one run, then their tokens decoded together
    assert runner.runs[0] == [(0, 2), (1, 2)]
    assert runner.runs[1] == [(0, 1), (1, 1)]
    assert sched.kv.check() == []


@pytest.mark.parametrize("chunk", [PREFILL_CHUNK_BUSY, 128])
def test_a_long_prompt_is_prefilled_in_chunks_while_another_sequence_keeps_decoding(chunk):
    sched, runner = make(n_parallel=2, prefill_chunk=chunk)
    first, _ = submit(sched, tokens_of("ab"), max_tokens=20)
    sched.admit()
    sched.step()  # the first prompt read: it decodes from now on
    long_prompt = tokens_of("abcdefghijklmno") * 100  # 1,500 tokens
    second, _ = submit(sched, long_prompt, max_tokens=2)
    drive(sched)
    chunks = [dict(r).get(1, 0) for r in runner.runs[1:]]
    decoded = [dict(r).get(0, 0) for r in runner.runs[1:]]
    assert max(chunks) == chunk and chunks[:2] == [chunk, chunk]
    assert all(decoded[:3]), "a prefill chunk stalled the decoding sequence"
    assert len(finished(first).token_ids) == 20 and finished(second).text == "ab"
    assert sched.kv.check() == []


@pytest.mark.parametrize("mode", [SpeculativeMode.OFF, SpeculativeMode.LOOKUP])
def test_drafts_go_in_the_plan_and_verification_keeps_the_text(mode):
    sched, runner = make(speculative=mode)
    handle, run = submit(sched, tokens_of("abcdefghijklmno") * 3, max_tokens=40)
    drive(sched)
    done = finished(handle)
    assert done.text == text_of([(i % 15) + 1 for i in range(40)])
    if mode is SpeculativeMode.LOOKUP:
        assert done.metrics.accepted_tokens > 0 and len(runner.runs) < 40  # several tokens a step
    else:
        assert len(runner.runs) == 40
    assert sched.kv.check() == []


def test_a_rejected_draft_leaves_the_cache_as_its_mirror():
    # the prompt repeats "abc" but the model goes on "abd...": the lookup guesses "c" and misses
    script = lambda toks: EOS if len(toks) > 30 else (cycle(toks) if toks[-1] != 2 else 4)  # noqa: E731
    sched, runner = make(speculative=SpeculativeMode.LOOKUP, script=script)
    handle, _ = submit(sched, tokens_of("abcabcabcab"))
    drive(sched)
    done = finished(handle)
    assert done.reason == "stop" and done.metrics.drafted_tokens > done.metrics.accepted_tokens
    assert sched.kv.check() == []


def test_each_way_a_request_ends():
    script = lambda toks: EOS if len(toks) >= 6 else cycle(toks)  # noqa: E731
    sched, _ = make(n_parallel=4, script=script)
    eos, _ = submit(sched, tokens_of("ab"))
    length, _ = submit(sched, tokens_of("ab"), max_tokens=2)
    stop, _ = submit(sched, tokens_of("ab"), stop=["d"])
    cancelled, _ = submit(sched, tokens_of("ab"), max_tokens=50)
    sched.admit()
    cancelled.cancel()
    drive(sched)
    assert (finished(eos).reason, finished(eos).text) == ("stop", "cdef")
    assert (finished(length).reason, finished(length).text) == ("length", "cd")
    assert (finished(stop).reason, finished(stop).text) == ("stop", "c")
    assert finished(cancelled).text == ""
    assert [e for e in cancelled.events() if isinstance(e, TextDelta)] == []
    assert sched.kv.check() == []


def test_the_check_sees_the_runner_cells_not_the_mirror():
    sched, runner = make()
    submit(sched, tokens_of("abcd"), max_tokens=2)
    drive(sched)
    assert sched.kv.check() == []
    runner.seq_rm(0, 2, 3)  # a hole the mirror does not know of
    assert sched.kv.check() != []


def test_a_full_sequence_makes_room_and_goes_on():
    sched, runner = make(n_ctx=64)
    handle, run = submit(sched, tokens_of("abcdefghijklmno") * 3, max_tokens=40)
    drive(sched)
    done = finished(handle)
    assert len(done.token_ids) == 40 and run.slot is not None and len(run.slot.tokens) <= 64
    assert sched.kv.check() == []
