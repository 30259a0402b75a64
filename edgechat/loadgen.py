"""A load generator for any OpenAI-compatible server (edgechat serve, llama.cpp's llama-server, vLLM).

Streams chat completions at a fixed concurrency with a long-tail mix of prompt lengths (mostly
short, some long, as real chat traffic is) and reports TTFT, TPOT and end-to-end latency
percentiles and output throughput.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

from edgechat.engine.types.metrics import percentile
from edgechat.openai_stream import StreamError, aiter_chunks

# Plain English words; prompts are random sequences of them so no two share more than the template.
_WORDS = (
    "river mountain quiet engine garden silver morning letter window market island winter "
    "forest signal harbor lantern pocket thunder mirror velvet ladder circle meadow copper "
    "whistle canyon ember feather marble orbit pepper saddle tunnel violet wander yellow anchor "
    "basket candle desert falcon glacier hollow ivory jungle kettle lemon needle oyster puzzle "
    "rocket shadow timber umbrella voyage walnut zephyr bridge cloud dragon echo fabric grain"
).split()

#: prompt lengths in tokens: a log-normal around 60 clipped to 20..400, as in the issue's reference run
_MIN_TOKENS, _MAX_TOKENS, _MEDIAN_TOKENS, _SIGMA = 20, 400, 60, 0.8
#: English words per token, roughly, for the tokenizers of small models
_WORDS_PER_TOKEN = 0.75


def prompt_token_targets(n: int, rng: random.Random) -> list[int]:
    return [
        int(min(_MAX_TOKENS, max(_MIN_TOKENS, rng.lognormvariate(math.log(_MEDIAN_TOKENS), _SIGMA)))) for _ in range(n)
    ]


def make_prompt(tokens: int, rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(max(1, int(tokens * _WORDS_PER_TOKEN) - 8))]
    return "Write a long story that uses these words: " + " ".join(words)


@dataclass
class RequestResult:
    prompt_tokens_target: int
    status: int = 0
    error: str | None = None
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Report:
    url: str
    model: str
    concurrency: int
    requests: int
    ok: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    ttft: dict = field(default_factory=dict)
    tpot: dict = field(default_factory=dict)
    e2e: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def table(self) -> str:
        lines = [
            f"{self.url}  model {self.model}  concurrency {self.concurrency}",
            f"requests {self.ok} ok / {self.failed} failed in {self.duration_s:.1f} s; "
            f"{self.output_tokens} output tokens, {self.output_tok_s:.1f} tok/s",
            f"{'':6}{'p50':>12}{'p95':>12}{'p99':>12}",
        ]
        for name, stats, scale, unit in (("TTFT", self.ttft, 1, "s"), ("TPOT", self.tpot, 1000, "ms"), ("E2E", self.e2e, 1, "s")):
            cells = "".join(f"{stats[p] * scale:>10.3f}{unit:<2}" for p in ("p50", "p95", "p99"))
            lines.append(f"{name:6}{cells}")
        for err in self.errors[:5]:
            lines.append(f"error: {err}")
        return "\n".join(lines)


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def _one(client: httpx.AsyncClient, base: str, model: str, prompt: str, target: int, max_tokens: int, seed: int) -> RequestResult:
    result = RequestResult(target)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        # every request generates exactly max_tokens, so servers are compared on equal work
        "ignore_eos": True,
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": 40,
        "min_p": 0.05,
        "seed": seed,
    }
    start = time.perf_counter()
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", f"{base}/chat/completions", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200].decode(errors='replace')}"
                return result
            async for chunk in aiter_chunks(response):
                if chunk.usage:
                    usage_tokens = chunk.usage.get("completion_tokens")
                if chunk.text:
                    if chunks == 0:
                        result.ttft = time.perf_counter() - start
                    chunks += 1
    except StreamError as exc:
        result.error = str(exc)[:200]
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - start
    # a server may merge several tokens into one chunk; its usage count is the truth when it sends one
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    return result


async def _model_id(client: httpx.AsyncClient, base: str) -> str:
    response = await client.get(f"{base}/models")
    response.raise_for_status()
    data = response.json().get("data") or []
    return data[0]["id"] if data else ""


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {p: percentile(ordered, q) for p, q in (("p50", 50), ("p95", 95), ("p99", 99))}


@dataclass
class Run:
    """One load run's raw material: per-request results and the wall time they took."""

    url: str
    model: str
    concurrency: int
    results: list[RequestResult]
    duration_s: float


def summarize(runs: list[Run]) -> Report:
    """One report over one or more runs at the same concurrency (throughput over their total time)."""
    results = [r for run in runs for r in run.results]
    duration = sum(run.duration_s for run in runs)
    ok = [r for r in results if r.ok]
    out = sum(r.output_tokens for r in ok)
    return Report(
        url=runs[0].url,
        model=runs[0].model,
        concurrency=runs[0].concurrency,
        requests=len(results),
        ok=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        output_tokens=out,
        output_tok_s=out / duration if duration > 0 else 0.0,
        ttft=_summary([r.ttft for r in ok]),
        tpot=_summary([t for r in ok if (t := r.tpot) is not None]),
        e2e=_summary([r.e2e for r in ok]),
        errors=[r.error for r in results if r.error],
    )


async def load(
    url: str,
    concurrency: int = 1,
    requests: int = 16,
    max_tokens: int = 128,
    seed: int = 0,
    api_key: str | None = None,
    warmup: int = 1,
    timeout: float = 900.0,
    prompts: list[str] | None = None,
) -> Run:
    """`prompts`, when given, are sent in turn instead of the long-tail mix (grounded work, say)."""
    base = _base_url(url)
    rng = random.Random(seed)
    if prompts:
        prompts = [prompts[i % len(prompts)] for i in range(requests)]
        targets = [int(len(p.split()) / _WORDS_PER_TOKEN) for p in prompts]
    else:
        targets = prompt_token_targets(requests, rng)
        prompts = [make_prompt(t, rng) for t in targets]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = await _model_id(client, base)
        for i in range(warmup):
            await _one(client, base, model, make_prompt(_MIN_TOKENS, rng), _MIN_TOKENS, 8, seed + 10_000 + i)
        pending = list(enumerate(zip(prompts, targets, strict=True)))
        pending.reverse()
        results: list[RequestResult] = []

        async def worker() -> None:
            while pending:
                i, (prompt, target) = pending.pop()
                results.append(await _one(client, base, model, prompt, target, max_tokens, seed + i))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    return Run(url, model, concurrency, results, duration)


async def run_load(url: str, concurrency: int = 1, requests: int = 16, max_tokens: int = 128, seed: int = 0, **kw) -> Report:
    return summarize([await load(url, concurrency, requests, max_tokens, seed, **kw)])


# ---- replayed traffic ----------------------------------------------------------------------


@dataclass(frozen=True)
class TraceEntry:
    """One request of a trace: when it arrives (seconds from the start), its prompt (text, or a
    length in tokens of words drawn from its `group`'s stream, so entries of one group share
    their beginning: an agent's fixed prefix and its growing history), and its answer's length."""

    at: float
    max_tokens: int
    prompt: str | None = None
    tokens: int = 0
    group: str | None = None


#: the shipped mixes, by name (`--trace chat|agents|document`); a JSONL file gives any other
MIXES = ("chat", "agents", "document")


def read_trace(path: str) -> list[TraceEntry]:
    """A JSONL trace: one object per line with `at`, `max_tokens`, and `prompt` (text) or `tokens`
    (with an optional `group`); a line that is none of these is a ValueError naming it."""
    entries = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                entry = TraceEntry(float(raw["at"]), int(raw.get("max_tokens", 128)), raw.get("prompt"), int(raw.get("tokens", 0)),
                                   raw.get("group"))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a trace entry ({exc}); give at, max_tokens, and prompt or tokens") from None
            if entry.at < 0 or entry.max_tokens < 1 or (entry.prompt is None and entry.tokens < 1):
                raise ValueError(f"{path}:{n}: at must be >= 0, max_tokens >= 1, and a prompt or tokens >= 1 given")
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path} holds no entries")
    return sorted(entries, key=lambda e: e.at)


def mix(name: str, seed: int = 0) -> list[TraceEntry]:
    """A shipped mix. chat: two minutes of long-tail chat, a request every 2 s on average;
    agents: three sessions of one agent (a 6,000-token prefix they share, 400 tokens of history
    more each turn, six turns 15 s apart); document: three chats asking every 4 s, and a
    16,000-token document arriving 10 s in."""
    rng = random.Random(seed)
    if name == "chat":
        at, out = 0.0, []
        for target in prompt_token_targets(60, rng):
            out.append(TraceEntry(round(at, 2), rng.choice((32, 64, 128, 256)), tokens=target))
            at += rng.expovariate(0.5)
        return out
    if name == "agents":
        return sorted((TraceEntry(turn * 15.0 + s * 5.0, 96, tokens=6000 + 400 * turn, group=f"session-{s}")
                       for s in range(3) for turn in range(6)), key=lambda e: e.at)
    if name == "document":
        chats = [TraceEntry(i * 4.0 + c, 64, tokens=100 + 50 * c, group=f"chat-{c}-{i}") for c in range(3) for i in range(10)]
        return sorted([*chats, TraceEntry(10.0, 64, tokens=16_000, group="document")], key=lambda e: e.at)
    raise ValueError(f"no mix {name!r}: {', '.join(MIXES)}, or a JSONL file")


def _text(entry: TraceEntry, index: int, seed: int) -> str:
    if entry.prompt is not None:
        return entry.prompt
    # a group's words are one stream: its entries' prompts are prefixes of each other; the
    # agents' sessions share their first 6,000 tokens (one agent, one system prompt)
    group = entry.group or f"request-{index}"
    shared = group.split("-", 1)[0] if group.startswith("session-") else group
    head = random.Random(f"{seed}:{shared}")
    words = [head.choice(_WORDS) for _ in range(int(min(entry.tokens, 6000) * _WORDS_PER_TOKEN))]
    rest = random.Random(f"{seed}:{group}")
    words += [rest.choice(_WORDS) for _ in range(int(max(0, entry.tokens - 6000) * _WORDS_PER_TOKEN))]
    return "Read these words, then answer with a story: " + " ".join(words)


@dataclass
class TraceReport:
    url: str
    model: str
    requests: int
    ok: int
    duration_s: float
    ttft: dict
    tpot: dict
    e2e: dict
    #: SLO met by both TTFT and TPOT: the share of requests, and good requests per second
    slo: dict
    goodput_share: float
    goodput_rps: float
    errors: dict[str, int]
    #: TTFT and TPOT tails by kind of request (a group's name before its first "-": chat,
    #: document, session; ungrouped ones are "request"), where a trace holds more than one kind
    kinds: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def table(self) -> str:
        lines = [f"{self.url}  model {self.model}  trace of {self.requests} requests in {self.duration_s:.1f} s",
                 f"{'':6}{'p50':>12}{'p95':>12}{'p99':>12}"]
        for name, stats, scale, unit in (("TTFT", self.ttft, 1, "s"), ("TPOT", self.tpot, 1000, "ms"), ("E2E", self.e2e, 1, "s")):
            lines.append(f"{name:6}" + "".join(f"{stats[p] * scale:>10.3f}{unit:<2}" for p in ("p50", "p95", "p99")))
        lines.append(f"goodput: {self.goodput_share:.0%} of requests within TTFT <= {self.slo['ttft_s']:g} s and TPOT <= "
                     f"{self.slo['tpot_s'] * 1000:g} ms ({self.goodput_rps:.2f} req/s)")
        for kind, tails in sorted(self.kinds.items()):
            lines.append(f"{kind} ({tails['ok']}): TTFT p50/p99 {tails['ttft']['p50']:.3f}/{tails['ttft']['p99']:.3f} s, "
                         f"TPOT p50/p99 {tails['tpot']['p50'] * 1000:.1f}/{tails['tpot']['p99'] * 1000:.1f} ms")
        lines += [f"errors: {kind}: {n}" for kind, n in sorted(self.errors.items())]
        return "\n".join(lines)


def _kind(entry: TraceEntry) -> str:
    return (entry.group or "request").split("-", 1)[0]


def _kinds(entries: list[TraceEntry], results: list[RequestResult]) -> dict[str, dict]:
    by_kind: dict[str, list[RequestResult]] = {}
    for entry, result in zip(entries, results, strict=True):
        if result.ok:
            by_kind.setdefault(_kind(entry), []).append(result)
    if len(by_kind) < 2:
        return {}
    return {kind: {"ok": len(rs), "ttft": _summary([r.ttft for r in rs]), "tpot": _summary([t for r in rs if (t := r.tpot) is not None])}
            for kind, rs in by_kind.items()}


async def replay(url: str, entries: list[TraceEntry], seed: int = 0, api_key: str | None = None, timeout: float = 900.0,
                 slo_ttft: float = 2.0, slo_tpot: float = 0.2, progress=None) -> TraceReport:
    """Send each entry at its time (whatever is still running), streamed; `progress(done, total)`
    after each ends."""
    base = _base_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(entries) + 1, max_keepalive_connections=8)
    done = 0
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = await _model_id(client, base)
        start = time.perf_counter()

        async def send(i: int, entry: TraceEntry) -> RequestResult:
            nonlocal done
            await asyncio.sleep(max(0.0, start + entry.at - time.perf_counter()))
            result = await _one(client, base, model, _text(entry, i, seed), entry.tokens, entry.max_tokens, seed + i)
            done += 1
            if progress is not None:
                progress(done, len(entries))
            return result

        results = await asyncio.gather(*(send(i, e) for i, e in enumerate(entries)))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = f"HTTP {r.status}" if r.status and r.status != 200 else (r.error or "error").split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
    return TraceReport(url, model, len(results), len(ok), duration, _summary([r.ttft for r in ok]),
                       _summary([t for r in ok if (t := r.tpot) is not None]), _summary([r.e2e for r in ok]),
                       {"ttft_s": slo_ttft, "tpot_s": slo_tpot}, len(good) / len(results), len(good) / duration if duration else 0.0, errors,
                       _kinds(entries, results))
