"""Code completion in an editor (issue 39): `edgechat serve`'s `/infill` against
`llama-server --cache-reuse 256`, the same Qwen2.5-Coder-0.5B-Instruct Q4_K_M file, the same
context, one sequence and the same threads on both, started by the bench on free loopback ports
and measured in the same run.

Keystrokes: a ~2,000-token source file (this repository's own modules, concatenated and cut at
a line), 20 fills at cursors moving down the file as an editor sends them while the user types:
the cursor halfway through a line whose rest is not written yet, the file before it as
`input_prefix`, the lines after it as `input_suffix`, `input_extra` empty, `n_predict` 32,
greedy, streamed. The servers take turns request by request (who goes first alternates), so a
machine whose load drifts weighs on both alike. Time to first token is measured at the client
(request sent to the first streamed event) for both; each server's own `timings.prompt_ms` is
reported beside it. Targets:

    TTFT p50 <= 0.7x llama-server's, p95 <= 0.9x; the same greedy completion on >= 18 of 20

Exact match: 30 lines cut from functions of this repository's code (a line of a function's
body removed, the cursor at the start of the empty line left, the function and the lines around
it as prefix and suffix); a fill (up to its first newline) scores when it equals the removed
line, both stripped.
Both servers' scores are reported: the same prompt tokens give the same answers, so they
should agree.

    python -m bench.bench_infill [--threads N] [--ctx 4096] [--file-tokens 2000] [--fills 20] [--cases 30] [--json]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.bench_serve import _free_port, _server
from bench.realmodel import real_model_path
from edgechat.models.planner import default_threads

ROOT = Path(__file__).resolve().parent.parent
#: the keystroke file: the first ~2,000 tokens of these, in this order
FILE_SOURCES = ("edgechat/engine/kv/kvcache.py", "edgechat/engine/prompt/prompt.py")
#: where the exact-match cases are cut from
CASE_SOURCES = ("edgechat/engine", "edgechat/server", "quantize")
N_PREDICT = 32
#: an exact-match case's context: from 15 lines before the function (at most 25 before the cut)
#: to 8 lines after it (at most 10 after the cut)
CASE_LINES_BEFORE, CASE_MAX_BEFORE, CASE_LINES_AFTER, CASE_MAX_AFTER = 15, 25, 8, 10
SERVERS = ("edgechat", "llama-server")


@dataclass
class Fill:
    """One /infill answer as the client saw it."""

    content: str
    #: the prompt as the server reports it (its tokens' text): the same for the same request
    prompt: str
    ttft_s: float
    total_s: float
    prompt_ms: float
    tokens_evaluated: int
    tokens_cached: int


@dataclass
class Results:
    fills: dict[str, list[Fill]] = field(default_factory=lambda: {name: [] for name in SERVERS})
    hits: dict[str, list[bool]] = field(default_factory=lambda: {name: [] for name in SERVERS})
    #: exact-match cases both servers answered alike
    agreed: int = 0


def commands(name: str, port: int, model: Path, ctx: int, threads: int, speculative: str, data_dir: Path) -> list[str]:
    if name == "llama-server":
        from bench.llamabench import find_llama_server
        from quantize.llm import use_extra_buffers

        return [str(find_llama_server()), "-m", str(model), "-c", str(ctx), "-np", "1", "-t", str(threads), "-tb", str(threads),
                "--cache-reuse", "256", "--no-webui", "--host", "127.0.0.1", "--port", str(port),
                *([] if use_extra_buffers() else ["--no-repack"])]
    return [sys.executable, "-m", "edgechat", "serve", "-m", str(model), "--ctx", str(ctx), "--parallel", "1",
            "--threads", str(threads), "--port", str(port), "--degrade-queue-wait", "0", "--speculative", speculative,
            # its own data folder: the prompt cache on disk of an earlier run would answer the first fills
            "--data-dir", str(data_dir)]


def source_file(client: httpx.Client, n_tokens: int, sources: tuple[str, ...] = FILE_SOURCES) -> str:
    """The keystroke file: `sources` (paths under the repository) concatenated, cut at the first
    line end past `n_tokens` (of the server behind `client`)."""
    text = "\n\n".join((ROOT / p).read_text() for p in sources)
    lines = text.splitlines(keepends=True)
    lo, hi = 1, len(lines)
    while lo < hi:  # the fewest lines that reach n_tokens
        mid = (lo + hi) // 2
        if n_tokens_of(client, "".join(lines[:mid])) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return "".join(lines[:lo])


def n_tokens_of(client: httpx.Client, text: str) -> int:
    r = client.post("/tokenize", json={"content": text})
    r.raise_for_status()
    return len(r.json()["tokens"])


def keystrokes(text: str, n_fills: int) -> list[tuple[str, str]]:
    """(prefix, suffix) of each fill, top to bottom: the cursor halfway through a line of code
    (its rest not typed yet), at lines spread evenly down the file."""
    lines = text.splitlines(keepends=True)
    starts = [sum(len(x) for x in lines[:i]) for i in range(len(lines))]
    eligible = [i for i, line in enumerate(lines) if len(line.strip()) >= 16 and not line.lstrip().startswith(("#", '"'))]
    out = []
    for k in range(n_fills):
        i = eligible[int((k + 0.5) * len(eligible) / n_fills)]
        line = lines[i].rstrip("\n")
        indent = len(line) - len(line.lstrip())
        cursor = starts[i] + indent + (len(line) - indent) // 2
        out.append((text[:cursor], text[starts[i] + len(line):]))
    return out


def cases(seed: int, n_cases: int) -> list[tuple[str, str, str]]:
    """(prefix, suffix, removed line) of each exact-match case: one line of a function's body
    (not its docstring, a comment or a lone bracket) cut out, the cursor at the start of the
    empty line left (a cursor after the indentation ends the prefix on a whitespace token the
    model rarely sees before a word: the 0.5B model then wrote the next line instead, 0 of 30)."""
    rng = random.Random(seed)
    files = sorted(p for src in CASE_SOURCES for p in (ROOT / src).rglob("*.py"))
    pool = []
    for path in files:
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
                continue
            body = node.body
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                body = body[1:]  # the docstring
            if not body or body[0].end_lineno is None:
                continue
            candidates = [i for i in range(body[0].lineno - 1, node.end_lineno)
                          if len(lines[i].strip()) >= 12 and not lines[i].lstrip().startswith(("#", ")", "]", "}"))]
            if len(candidates) >= 3:
                pool.append((lines, rng.choice(candidates), node.lineno - 1, node.end_lineno))
    out = []
    for lines, i, start, end in rng.sample(pool, n_cases):
        prefix = "".join(lines[max(0, start - CASE_LINES_BEFORE, i - CASE_MAX_BEFORE) : i])
        suffix = "\n" + "".join(lines[i + 1 : min(len(lines), end + CASE_LINES_AFTER, i + 1 + CASE_MAX_AFTER)])
        out.append((prefix, suffix, lines[i].strip()))
    return out


def infill(client: httpx.Client, prefix: str, suffix: str, **fields) -> Fill:
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": [], "n_predict": N_PREDICT,
            "temperature": 0, "stream": True, **fields}
    sent = time.perf_counter()
    first = None
    parts: list[str] = []
    last: dict = {}
    with client.stream("POST", "/infill", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if first is None:
                first = time.perf_counter()
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"/infill failed: {event['error']}")
            parts.append(event.get("content", ""))
            last = event
    done = time.perf_counter()
    timings = last.get("timings", {})
    # timings.cache_n: the prompt tokens reused (llama-server's tokens_cached counts the answer too)
    return Fill("".join(parts), last.get("prompt", ""), (first or done) - sent, done - sent, timings.get("prompt_ms", 0.0),
                last.get("tokens_evaluated", 0), timings.get("cache_n", 0))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--file-tokens", type=int, default=2000)
    ap.add_argument("--fills", type=int, default=20)
    ap.add_argument("--cases", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", default="auto", help="edgechat's --speculative (off: to tell a near-tie from drafting)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-dir", type=Path, help="where the servers' logs go (default: a new temporary folder)")
    args = ap.parse_args(argv)

    model = real_model_path()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-infill-"))
    print(f"server logs in {log_dir}", file=sys.stderr)
    res = Results()
    with contextlib.ExitStack() as stack:
        clients = {}
        for name in SERVERS:
            port = _free_port()
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-infill-data-")))
            url = stack.enter_context(_server(commands(name, port, model, args.ctx, args.threads, args.speculative, data_dir), port, name, log_dir))
            # a new connection per request: llama-server closed a kept-alive one under a request
            # sent a moment after a minute-long answer (loopback connects cost both alike, ~0.1 ms)
            clients[name] = stack.enter_context(httpx.Client(base_url=url, timeout=1800, limits=httpx.Limits(max_keepalive_connections=0)))
        text = source_file(clients["llama-server"], args.file_tokens)
        file_tokens = n_tokens_of(clients["llama-server"], text)
        for name in SERVERS:  # weights paged in, first-request costs paid, before anything is timed
            infill(clients[name], "def add(a, b):\n    ", "\n")
        for k, (prefix, suffix) in enumerate(keystrokes(text, args.fills)):
            for name in SERVERS[k % 2 :] + SERVERS[: k % 2]:
                fill = infill(clients[name], prefix, suffix)
                res.fills[name].append(fill)
                print(f"fill {k + 1}/{args.fills} {name}: TTFT {fill.ttft_s:.3f} s, {fill.tokens_evaluated} prompt tokens, "
                      f"{fill.tokens_cached} cached", file=sys.stderr)
            ours, theirs = res.fills["edgechat"][-1].content, res.fills["llama-server"][-1].content
            if ours != theirs:
                same_prompt = res.fills["edgechat"][-1].prompt == res.fills["llama-server"][-1].prompt
                print(f"fill {k + 1}: the completions differ ({'same' if same_prompt else 'DIFFERENT'} prompts): {ours!r} / {theirs!r}",
                      file=sys.stderr)
        for k, (prefix, suffix, removed) in enumerate(cases(args.seed, args.cases)):
            answers = {}
            for name in SERVERS[k % 2 :] + SERVERS[: k % 2]:
                # only the first line is scored: the rest is not generated
                answers[name] = infill(clients[name], prefix, suffix, stop=["\n"]).content.strip()
                res.hits[name].append(answers[name] == removed)
            res.agreed += answers["edgechat"] == answers["llama-server"]
            print(f"case {k + 1}/{args.cases}: {removed!r}: " + ", ".join(f"{n} {answers[n]!r}" for n in SERVERS), file=sys.stderr)

    def summary(name: str) -> dict:
        fills = res.fills[name]
        # nan with --fills 0 (only the exact-match cases run)
        ttft = [f.ttft_s for f in fills] or [math.nan]
        prompt = [f.prompt_ms / 1e3 for f in fills] or [math.nan]
        return {"ttft_p50_s": statistics.median(ttft), "ttft_p95_s": percentile(ttft, 0.95),
                "prompt_ms_p50_s": statistics.median(prompt), "prompt_ms_p95_s": percentile(prompt, 0.95),
                "total_s": sum(f.total_s for f in fills), "prompt_tokens": sum(f.tokens_evaluated for f in fills),
                "cached_tokens": sum(f.tokens_cached for f in fills), "exact_match": sum(res.hits[name])}

    ours, theirs = summary("edgechat"), summary("llama-server")
    pairs = list(zip(res.fills["edgechat"], res.fills["llama-server"], strict=True))
    same = sum(a.content == b.content for a, b in pairs)
    same_prompts = sum(a.prompt == b.prompt for a, b in pairs)
    ratios = {"ttft_p50": ours["ttft_p50_s"] / theirs["ttft_p50_s"], "ttft_p95": ours["ttft_p95_s"] / theirs["ttft_p95_s"],
              "prompt_ms_p50": ours["prompt_ms_p50_s"] / theirs["prompt_ms_p50_s"],
              "total": ours["total_s"] / theirs["total_s"] if pairs else math.nan}
    targets = {"ttft_p50": ratios["ttft_p50"] <= 0.7, "ttft_p95": ratios["ttft_p95"] <= 0.9, "same_completions": same >= 0.9 * args.fills}
    report = {"model": model.name, "threads": args.threads, "ctx": args.ctx, "speculative": args.speculative, "file_tokens": file_tokens,
              "edgechat": ours, "llama-server": theirs, "same_completions": same, "same_prompts": same_prompts, "same_case_answers": res.agreed, "ratios": ratios, "targets_met": targets,
              "completions": [[a.content, b.content] for a, b in pairs]}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{model.name}, {file_tokens}-token file, ctx {args.ctx}, 1 sequence, {args.threads} threads, speculative {args.speculative}")
    print(f"{'':14}{'TTFT p50':>10}{'TTFT p95':>10}{'prompt_ms p50':>15}{'total':>9}{'prompt tok':>12}{'cached':>8}{'exact':>8}")
    for name, s in (("edgechat", ours), ("llama-server", theirs)):
        print(f"{name:14}{s['ttft_p50_s']:9.3f}s{s['ttft_p95_s']:9.3f}s{s['prompt_ms_p50_s']:14.3f}s{s['total_s']:8.1f}s"
              f"{s['prompt_tokens']:12}{s['cached_tokens']:8}{s['exact_match']:5}/{args.cases}")
    for name, value in ratios.items():
        mark = f"  (target: {'met' if targets[name] else 'MISSED'})" if name in targets else ""
        print(f"{name:14} {value:.2f}x{mark}")
    print(f"exact-match cases answered alike by both: {res.agreed}/{args.cases}")
    print(f"same completions: {same}/{args.fills}  (target: {'met' if targets['same_completions'] else 'MISSED'}); same prompt tokens: {same_prompts}/{args.fills}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
