"""Prometheus metrics of one server: its own registry, so two apps in one process never share counts."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from edgechat.engine.pool import PoolModel
from edgechat.engine.types.request import RequestMetrics
from edgechat.sysmem import MemoryReading

#: what happened to a request, as counted in edgechat_requests_total{outcome=...}
OUTCOMES = ("ok", "cancelled", "timeout", "rejected", "error")

# From one token on a fast desktop to minutes of queueing on a phone.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
#: token counts from a one-line question to an agent's whole prefix, doubling: the P99 of
#: prompt lengths is what --ctx should hold
_TOKEN_BUCKETS = tuple(float(16 << i) for i in range(14))  # 16 .. 131072


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_wait = Histogram(
            "edgechat_queue_wait_seconds", "Time from arrival to the start of prefill.", buckets=_LATENCY_BUCKETS, labelnames=["model", "priority"], registry=r
        )
        self.ttft = Histogram(
            "edgechat_time_to_first_token_seconds", "Time from arrival to the first output token.", buckets=_LATENCY_BUCKETS, labelnames=["model", "priority"], registry=r
        )
        self.tpot = Histogram(
            "edgechat_time_per_output_token_seconds", "Mean gap between output tokens after the first, per request.", buckets=_TPOT_BUCKETS, labelnames=["model", "priority"], registry=r
        )
        self.e2e = Histogram(
            "edgechat_request_duration_seconds", "Time from arrival to the last token (end to end).", buckets=_LATENCY_BUCKETS, labelnames=["model", "priority"], registry=r
        )
        self.prompt_tokens = Counter("edgechat_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.prompt_lengths = Histogram("edgechat_request_prompt_tokens", "Prompt tokens per finished request.", buckets=_TOKEN_BUCKETS,
                                        labelnames=["model", "priority"], registry=r)
        self.output_lengths = Histogram("edgechat_request_output_tokens", "Generated tokens per finished request.", buckets=_TOKEN_BUCKETS,
                                        labelnames=["model", "priority"], registry=r)
        self.in_flight = Histogram("edgechat_requests_in_flight", "Requests running or queued on the model as one arrives, itself "
                                   "counted: the concurrency --parallel should hold.", buckets=tuple(float(n) for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)),
                                   labelnames=["model"], registry=r)
        self.rejections = Counter("edgechat_rejections", "Requests refused before any compute, by reason (the error code: queue_full, "
                                  "context_length_exceeded, model_memory_full, timeout, ...).", ["reason"], registry=r)
        self.process_rss = Gauge("edgechat_process_resident_bytes", "This server's resident memory (VmRSS).", registry=r)
        self.mem_available = Gauge("edgechat_memory_available_bytes", "The machine's available memory (MemAvailable).", registry=r)
        self.cgroup_limit = Gauge("edgechat_cgroup_memory_limit_bytes", "The memory cgroup's limit (absent: none set).", registry=None)
        self.cgroup_usage = Gauge("edgechat_cgroup_memory_usage_bytes", "The memory cgroup's usage.", registry=None)
        self._shown: set[Gauge] = set()
        self.cached_tokens = Counter("edgechat_prompt_cached_tokens", "Prompt tokens taken from the KV cache instead of prefilled.", registry=r)
        self.prompt_cache_hits = Counter("edgechat_prompt_cache_hits", "Requests whose prompt prefix was restored from the prompt cache (host RAM).", registry=r)
        self.prompt_cache_misses = Counter("edgechat_prompt_cache_misses", "Requests for which the prompt cache held no longer prefix than the sequences.", registry=r)
        self.prompt_cache_restored_tokens = Counter("edgechat_prompt_cache_restored_tokens", "Prompt tokens restored from the prompt cache instead of prefilled.", registry=r)
        self.prompt_cache_bytes = Gauge("edgechat_prompt_cache_bytes", "Bytes of KV state held by the prompt cache.", registry=r)
        self.prompt_cache_entries = Gauge("edgechat_prompt_cache_entries", "Prompt states held by the prompt cache.", registry=r)
        self.completion_tokens = Counter("edgechat_completion_tokens", "Generated tokens.", registry=r)
        self.draft_tokens = Counter("edgechat_draft_tokens", "Tokens guessed by speculative decoding and verified.", registry=r)
        self.draft_accepted_tokens = Counter("edgechat_draft_accepted_tokens", "Guessed tokens the model agreed with (kept).", registry=r)
        self.requests = Counter("edgechat_requests", "Generation requests by outcome (rejected: refused before any compute, for a full queue or a long prompt).", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.running = Gauge("edgechat_running_sequences", "Sequences being generated now.", registry=r)
        self.queued = Gauge("edgechat_queued_requests", "Requests waiting for a sequence.", registry=r)
        self.kv_used = Gauge("edgechat_kv_cells_used", "KV cache cells held by running sequences.", registry=r)
        self.kv_cached = Gauge("edgechat_kv_cells_cached", "KV cache cells kept in idle sequences for prefix reuse.", registry=r)
        self.kv_total = Gauge("edgechat_kv_cells_total", "KV cache cells in the context.", registry=r)
        self.degraded = Gauge("edgechat_degraded", "1 while the degrade switch caps max_tokens, else 0.", registry=r)
        self.degrade_switches = Counter("edgechat_degrade_switches", "Times the degrade switch turned on.", registry=r)
        self.fallback_requests = Counter("edgechat_fallback_requests", "Requests routed to the fallback model while degraded.", registry=r)
        self.tool_requests = Counter("edgechat_tool_requests", "Chat requests that offered tools the model may call.", registry=r)
        self.tool_calls = Counter("edgechat_tool_calls", "Tool calls returned to clients.", registry=r)
        self.failovers = Counter("edgechat_failovers", "Requests moved to the fallback model after no first token within their failover time.", registry=r)
        self.class_running = Gauge("edgechat_priority_running", "Sequences held by each priority class.", ["priority"], registry=r)
        self.class_queued = Gauge("edgechat_priority_queued", "Requests waiting for their priority class's share.", ["priority"], registry=r)
        self._model_series(r)
        self.grammar_requests = Counter("edgechat_grammar_requests", "Requests held to a grammar (response_format or tool calls).", registry=r)

    def _model_series(self, r: CollectorRegistry) -> None:
        """The models' lifecycle: loads, failures, unloads, what is resident."""
        self.model_loads = Counter("edgechat_model_loads", "Models loaded because a request asked for one.", ["model"], registry=r)
        self.model_load_failures = Counter("edgechat_model_load_failures", "Loads that failed (a corrupt or missing file).", ["model"], registry=r)
        self.model_unloads = Counter("edgechat_model_unloads", "Models unloaded (idle, keep_alive, to make room, at shutdown).", ["model"], registry=r)
        self.model_load_seconds = Histogram("edgechat_model_load_seconds", "Time to load a model.", buckets=_LATENCY_BUCKETS, labelnames=["model"], registry=r)
        self.resident_models = Gauge("edgechat_resident_models", "Models loaded now.", registry=r)
        self.resident_bytes = Gauge("edgechat_resident_model_bytes", "Memory the loaded models take, as the planner counts it (weights, KV cache, compute).", registry=r)

    def add_model(self, model: str, classes: list[str]) -> None:
        """Export a served model's latency series from the start (at zero), as the outcomes are."""
        for histogram in (self.queue_wait, self.ttft, self.tpot, self.e2e, self.prompt_lengths, self.output_lengths):
            for priority in classes:
                histogram.labels(model, priority)

    def observe_finished(self, m: RequestMetrics, outcome: str, model: str, priority: str) -> None:
        """Count a finished request; latencies by the model that served it (primary or fallback)
        and its priority class."""
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(m.prompt_tokens)
        self.cached_tokens.inc(m.cached_tokens)
        if m.prompt_cache_hit is not None:
            (self.prompt_cache_hits if m.prompt_cache_hit else self.prompt_cache_misses).inc()
        self.prompt_cache_restored_tokens.inc(m.restored_tokens)
        self.completion_tokens.inc(m.completion_tokens)
        self.draft_tokens.inc(m.drafted_tokens)
        self.draft_accepted_tokens.inc(m.accepted_tokens)
        if outcome != "ok":
            # a cancelled request's latencies describe the client, not the server
            return
        self.queue_wait.labels(model, priority).observe(m.queue_wait)
        self.prompt_lengths.labels(model, priority).observe(m.prompt_tokens)
        self.output_lengths.labels(model, priority).observe(m.completion_tokens)
        if m.completion_tokens > 0:
            self.ttft.labels(model, priority).observe(m.ttft)
        if m.completion_tokens > 1:
            self.tpot.labels(model, priority).observe(m.tpot_mean)
        self.e2e.labels(model, priority).observe(m.total)

    def observe_pool(self, event: str, model, seconds: float) -> None:
        """The model pool's news (engine/pool.py), from whichever thread loaded or unloaded."""
        if event == "load":
            self.model_loads.labels(model.name).inc()
            self.model_load_seconds.labels(model.name).observe(seconds)
        elif event == "load_failed":
            self.model_load_failures.labels(model.name).inc()
        elif event == "unload":
            self.model_unloads.labels(model.name).inc()

    def render(self, stats: dict, degraded: bool, classes: dict[str, dict[str, int]], resident: Sequence[PoolModel] = (),
               memory: MemoryReading | None = None) -> bytes:
        """The text exposition, with the gauges read from the engines, the pool and /proc at scrape time."""
        if memory is not None:
            self._memory(memory)
        self.resident_models.set(len(resident))
        self.resident_bytes.set(sum(m.need for m in resident))
        self.running.set(stats.get("running", 0))
        self.queued.set(stats.get("waiting", 0))
        self.kv_used.set(stats.get("kv_used", 0))
        self.kv_cached.set(stats.get("kv_cached", 0))
        self.kv_total.set(stats.get("kv_total", 0))
        self.prompt_cache_bytes.set(stats.get("prompt_cache_bytes", 0))
        self.prompt_cache_entries.set(stats.get("prompt_cache_entries", 0))
        self.degraded.set(1 if degraded else 0)
        for name, state in classes.items():
            self.class_running.labels(name).set(state["running"])
            self.class_queued.labels(name).set(state["waiting"])
        return generate_latest(self.registry)

    def _memory(self, m: MemoryReading) -> None:
        if m.rss is not None:
            self.process_rss.set(m.rss)
        self.mem_available.set(m.available)
        for gauge, value in ((self.cgroup_limit, m.cgroup_limit), (self.cgroup_usage, m.cgroup_usage)):
            if value is not None:
                if gauge not in self._shown:  # absent until there is a value: a 0-byte limit would read as full
                    self.registry.register(gauge)
                    self._shown.add(gauge)
                gauge.set(value)
