"""What thinking costs (issue 25), on an embedded model given a thinking template (SmolLM2: the
Qwen3-style one tests/test_reasoning.py writes; Gemma 3: the same rules in Gemma's turns; no
embedded model thinks):

- decode: the same greedy 192 tokens with the reasoning splitter on (the template opens a block,
  so every token passes through it) against the same engine with `split_reasoning` off (the
  text as it is): target >= 0.98x. Runs alternate, the median of their ratios is printed. Beside
  it, what each splitter (<think>, harmony's channels) adds to a token by CPU time, as a share
  of a decode step.
- ten turns of one conversation, each turn's thoughts left out of the next prompt: the TTFT of
  turn 10 against turn 2 (prefix reuse must hold while the template drops old thoughts): target
  <= 1.3x. Beside it, the floor: the same two turns' new tokens at their depths in one raw
  llama_decode each (a scratch context; flash attention as the engine's, and off), the ratio no
  engine can beat, and the tokens prefilled per turn (constant when prefix reuse holds).

- with `--flash-attn` (the engine's setting), llama.cpp's own llama-bench beside it at the same
  threads, flash attention on and off in alternate rounds: prompt t/s for turn 10's new tokens at
  its depth and decode t/s, so a flash-attention default is chosen on numbers that do not depend
  on this engine.

    python -m bench.bench_reasoning [--model gemma3-270m] [--flash-attn auto|on|off] [--rounds 5] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from edgechat.config import Paths, get_paths
from edgechat.engine import ChatRequest, Engine, EngineConfig, SamplingParams
from edgechat.engine.output.reasoning import ChannelFormat
from edgechat.engine.output.stream import OutputProcessor
from edgechat.engine.runners.llama import Batch, LlamaBackend

MODEL = "smollm2-135m-instruct"
#: SmolLM2's thinking template (ChatML turns)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] | trim }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
#: the same rules in Gemma 3's turns
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] | trim }}{% else %}{{ m['content'] }}{% endif %}"
    "<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
TEMPLATES = {MODEL: TEMPLATE, "gemma3-270m": GEMMA_TEMPLATE}
GREEDY = SamplingParams(temperature=0)
ASK = [{"role": "user", "content": "Think step by step: how does a refrigerator keep food cold?"}]


def decode_ratio(engine: Engine, rounds: int) -> dict:
    def run(split: bool) -> float:
        return engine.submit(ChatRequest(messages=ASK, sampling=GREEDY, max_tokens=192, ignore_eos=True,
                                         split_reasoning=split, speculative="off")).result().metrics.decode_tps

    run(True)  # the first answer pays for cold weights and caches: it is not measured
    ratios, split_tps, plain_tps = [], [], []
    for i in range(rounds):
        runs = {}
        for split in (True, False) if i % 2 == 0 else (False, True):  # neither side always goes first
            runs[split] = run(split)
        split_tps.append(runs[True])
        plain_tps.append(runs[False])
        ratios.append(runs[True] / runs[False])
    return {"split_tps": statistics.median(split_tps), "plain_tps": statistics.median(plain_tps), "ratio": statistics.median(ratios)}


#: harmony's channels on SmolLM2's own control tokens (as tests/test_reasoning.py stands them in)
STAND_IN_CHANNELS = ChannelFormat(start="<|im_start|>", channel="<jupyter_code>", message="<jupyter_output>",
                                  end="<jupyter_text>", constrain="<jupyter_script>")


def splitter_cost(engine: Engine, tps: float) -> dict:
    """What each splitter adds to a token, by the thread's CPU clock (nearly free of a shared
    machine's load): the decode test's tokens through the output processor alone, without a
    splitter, with the <think> one and with harmony's (its markers stood in by SmolLM2's control
    tokens, the thoughts' message opened by the prompt), as a share of one decode step at `tps`."""
    be = engine.backend
    done = engine.submit(ChatRequest(messages=ASK, sampling=GREEDY, max_tokens=192, ignore_eos=True, speculative="off")).result()
    pieces = [(be.piece(t), t) for t in done.token_ids]
    fmt = engine.format.reasoning
    splitters = {"think": lambda: fmt.splitters(be.tokenize)(True, [])}
    if all(len(be.tokenize(marker)) == 1 for marker in STAND_IN_CHANNELS.markers):  # SmolLM2's vocabulary
        opened = be.tokenize(f"{STAND_IN_CHANNELS.start}assistant{STAND_IN_CHANNELS.channel}analysis{STAND_IN_CHANNELS.message}")
        splitters["harmony"] = lambda: STAND_IN_CHANNELS.splitters(be.tokenize)(True, opened)

    def per_token(make) -> float:
        best = float("inf")
        for _ in range(20):
            proc = OutputProcessor(["STOP"], splitter=make())
            began = time.thread_time()
            for data, token in pieces:
                proc.feed(data, token)
            proc.finish()
            best = min(best, (time.thread_time() - began) / len(pieces))
        return best

    plain = per_token(lambda: None)
    out = {"plain_us_per_token": plain * 1e6}
    for name, make in splitters.items():
        added = per_token(make) - plain  # below 0: thoughts skip the stop-string search the answer gets
        out[name] = {"us_per_token": added * 1e6, "share_of_step": added * tps}
    return out


def ten_turns(engine: Engine, session: str, rounds: int) -> dict:
    history, ttft, cached, prompts = [], [], [], []
    for turn in range(10):
        history.append({"role": "user", "content": f"Question {turn + 1}: name a city and one thing it is known for."})
        request = ChatRequest(messages=list(history), sampling=GREEDY, max_tokens=48, reasoning_budget=16, session=session)
        prompts.append(engine.prompt_tokens(request))
        done = engine.submit(request).result()
        ttft.append(done.metrics.ttft)
        cached.append(done.metrics.cached_tokens)
        history.append({"role": "assistant", "content": done.text})
    turns = [(prompts[1], cached[1]), (prompts[9], cached[9])]
    return {"ttft": ttft, "cached": cached, "prefilled": [len(p) - c for p, c in zip(prompts, cached, strict=True)],
            "ratio": ttft[9] / ttft[1],
            "floor": {fa: decode_floor(engine, turns, fa, rounds) for fa in dict.fromkeys((engine.config.flash_attn, "off"))}}


def decode_floor(engine: Engine, turns: list[tuple[list[int], int]], flash_attn: str, rounds: int) -> float:
    """The raw llama_decode of turn 10's new tokens after its cached ones, against turn 2's
    (median of paired ratios), in a scratch context of the engine's shape: what attention over a
    longer cache costs the model itself, whatever the engine does around it."""
    be = LlamaBackend(engine.model_path, n_ctx_total=engine.n_ctx, n_seq_max=1, n_threads=engine.n_threads,
                      flash_attn=flash_attn)
    batch = Batch(max(len(tokens) for tokens, _ in turns), 1)

    def decode(tokens: list[int], start: int) -> float:
        batch.clear()
        for i in range(start, len(tokens)):
            batch.add(tokens[i], i, 0, i == len(tokens) - 1)
        began = time.perf_counter()
        be.decode(batch)
        return time.perf_counter() - began

    def new_tokens(tokens: list[int], cached: int) -> float:
        be.seq_rm(0)
        decode(tokens[:cached], 0)
        return decode(tokens, cached)

    try:
        ratios = []
        for _ in range(rounds):
            shallow, deep = (new_tokens(*turn) for turn in turns)
            ratios.append(deep / shallow)
        return statistics.median(ratios)
    finally:
        batch.close()
        be.close()


def _cpu_seconds(be: LlamaBackend, batch: Batch, tokens: list[int], start: int, stop: int, one_by_one: bool) -> float:
    """The thread's CPU time to decode tokens[start:stop] on sequence 0, in one batch or one token at a time."""
    spent = 0.0
    for lo in range(start, stop) if one_by_one else (start,):
        hi = lo + 1 if one_by_one else stop
        batch.clear()
        for i in range(lo, hi):
            batch.add(tokens[i], i, 0, i == hi - 1)
        began = time.thread_time()
        be.decode(batch)
        spent += time.thread_time() - began
    return spent


def cpu_cost(model_path: Path, depth: int, n_prompt: int, rounds: int, n_gen: int = 64) -> dict:
    """Raw llama_decode in a scratch one-thread context, flash attention on and off in alternate
    rounds, timed by the thread's own CPU clock (one thread computes in the caller's): what each
    setting costs the model itself, which a shared machine's load leaves nearly untouched, unlike
    wall-clock tokens/s. Prefill of `n_prompt` tokens after `depth` cached ones (a chat turn deep
    in a conversation), and `n_gen` one-token decodes from an empty cache and after `depth`."""
    got: dict[str, dict[str, list[float]]] = {fa: {"pp_tps": [], "tg_tps": [], "tg_deep_tps": []} for fa in ("on", "off")}
    for _ in range(rounds):
        for fa, out in got.items():
            be = LlamaBackend(model_path, n_ctx_total=4096, n_seq_max=1, n_threads=1, flash_attn=fa)
            batch = Batch(max(depth, n_prompt, 1), 1)
            tokens = [be.tokenize(" the")[0]] * (depth + n_prompt + n_gen)
            try:
                out["tg_tps"].append(n_gen / _cpu_seconds(be, batch, tokens, 0, n_gen, True))
                be.seq_rm(0)
                _cpu_seconds(be, batch, tokens, 0, depth, False)
                out["pp_tps"].append(n_prompt / _cpu_seconds(be, batch, tokens, depth, depth + n_prompt, False))
                be.seq_rm(0, depth)
                out["tg_deep_tps"].append(n_gen / _cpu_seconds(be, batch, tokens, depth, depth + n_gen, True))
            finally:
                batch.close()
                be.close()
    result = {fa: {k: statistics.median(v) for k, v in out.items()} for fa, out in got.items()}
    for k in ("pp_tps", "tg_tps", "tg_deep_tps"):
        result[f"{k}_off_on"] = statistics.median(off / on for off, on in zip(got["off"][k], got["on"][k], strict=True))
    return result


def reference(model_path: Path, threads: int, turns: dict, rounds: int) -> dict:
    """llama-bench at the engine's threads, flash attention on and off in alternate rounds (a
    shared machine's load drifts; paired ratios off/on, median): turn 10's new tokens prefilled
    at its depth, and 192 tokens decoded from an empty cache (the decode test's length)."""
    from bench.llamabench import run_llama_bench

    depth, n_prompt = turns["cached"][9], turns["prefilled"][9]
    runs: dict[str, dict[str, list[float]]] = {fa: {"pp_tps": [], "tg_tps": []} for fa in ("on", "off")}
    for _ in range(rounds):
        for fa, got in runs.items():
            got["pp_tps"].append(run_llama_bench(model_path, threads=threads, n_prompt=n_prompt, n_gen=0, repetitions=2,
                                                 n_depth=depth, flash_attn=fa)["pp_tps"])
            got["tg_tps"].append(run_llama_bench(model_path, threads=threads, n_prompt=0, n_gen=192, repetitions=2,
                                                 flash_attn=fa)["tg_tps"])
    out = {"depth": depth, "n_prompt": n_prompt, "n_gen": 192,
           **{fa: {k: statistics.median(v) for k, v in got.items()} for fa, got in runs.items()}}
    for k in ("pp_tps", "tg_tps"):
        out[f"{k}_off_on"] = statistics.median(off / on for off, on in zip(runs["off"][k], runs["on"][k], strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=sorted(TEMPLATES), default=MODEL)
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default=None,
                        help="the engine's flash attention (default: its own), measured beside llama-bench's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = Paths(data=Path(tmp), cache=get_paths().cache, config=Path(tmp) / "config")
        config = EngineConfig(model=args.model, n_ctx=4096, n_threads=args.threads, paths=paths,
                              chat_template=TEMPLATES[args.model], flash_attn=args.flash_attn or "auto")
        with Engine(config) as engine:
            result = {"decode": decode_ratio(engine, args.rounds), "ten_turns": ten_turns(engine, "thinking", args.rounds)}
            result["splitters"] = splitter_cost(engine, result["decode"]["plain_tps"])
            model_path = engine.model_path
        # the reference: the same conversation on the model's own template (no thoughts to drop),
        # where a turn's TTFT grows with the context alone
        with Engine(dataclasses.replace(config, chat_template=None)) as engine:
            result["ten_turns_plain"] = ten_turns(engine, "plain", args.rounds)
    if args.flash_attn is not None:
        result["llama_bench"] = reference(model_path, args.threads, result["ten_turns"], args.rounds)
        t = result["ten_turns"]
        result["cpu"] = cpu_cost(model_path, t["cached"][9], t["prefilled"][9], max(args.rounds, 3))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    d = result["decode"]
    print(f"decode with the splitter: {d['split_tps']:.1f} t/s, plain {d['plain_tps']:.1f} t/s, "
          f"median paired ratio {d['ratio']:.3f} (target >= 0.98)")
    costs = result["splitters"]
    for name, c in costs.items():
        if name != "plain_us_per_token":
            print(f"the {name} splitter by CPU time: {c['us_per_token']:+.1f} us a token beside the output processor's own "
                  f"{costs['plain_us_per_token']:.1f} us ({c['share_of_step'] * 100:+.3f}% of a decode step)")
    for label, t in (("ten turns", result["ten_turns"]), ("same turns without thinking", result["ten_turns_plain"])):
        floor = ", ".join(f"{r:.2f} (flash attention {fa})" for fa, r in t["floor"].items())
        print(f"{label}: TTFT turn 2 {t['ttft'][1] * 1000:.0f} ms, turn 10 {t['ttft'][9] * 1000:.0f} ms, "
              f"ratio {t['ratio']:.2f} (target <= 1.3); raw llama_decode of the same new tokens at the same depths: "
              f"{floor}; cached tokens by turn {t['cached']}, prefilled {t['prefilled']}")
    if "llama_bench" in result:
        r = result["llama_bench"]
        t = result["ten_turns"]
        print(f"engine, flash attention {args.flash_attn}: decode {d['plain_tps']:.1f} t/s, turn 10's prefill "
              f"{t['prefilled'][9] / t['ttft'][9]:.1f} t/s (with its TTFT's other work)")
        print(f"llama-bench, same threads: tg{r['n_gen']} on {r['on']['tg_tps']:.1f} / off {r['off']['tg_tps']:.1f} t/s "
              f"(off/on {r['tg_tps_off_on']:.2f}); pp{r['n_prompt']} at depth {r['depth']} on {r['on']['pp_tps']:.1f} / "
              f"off {r['off']['pp_tps']:.1f} t/s (off/on {r['pp_tps_off_on']:.2f})")
        c = result["cpu"]
        print(f"raw llama_decode, one thread, CPU time: tg64 on {c['on']['tg_tps']:.1f} / off {c['off']['tg_tps']:.1f} t/s "
              f"(off/on {c['tg_tps_off_on']:.2f}); tg64 at depth {r['depth']} off/on {c['tg_deep_tps_off_on']:.2f}; "
              f"pp{r['n_prompt']} at depth {r['depth']} on {c['on']['pp_tps']:.1f} / off {c['off']['pp_tps']:.1f} t/s "
              f"(off/on {c['pp_tps_off_on']:.2f})")


if __name__ == "__main__":
    main()
