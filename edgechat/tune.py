"""What a server should be started with, read from the traffic it saw: the context from the P99
of prompt plus answer lengths (the article's rule: size the window for the tail, not the mean),
the sequences from the requests in flight as each arrived (P95), and the KV type from whether
that plan fits the memory there is, as the planner counts it. Every proposal says its arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from edgechat.models import planner, read_model_info
from edgechat.params import KVType

#: room above the longest requests seen, and the step the context is rounded up to
CTX_ROOM, CTX_STEP, MIN_CTX = 1.10, 256, 512


@dataclass
class Proposal:
    model: str
    ctx: int
    parallel: int
    kv_type: str | None  # None: no KV type fits
    lines: list[str] = field(default_factory=list)

    def flags(self) -> str:
        kv = f" --kv-type {self.kv_type}" if self.kv_type else ""
        return f"--ctx {self.ctx} --parallel {self.parallel}{kv}"


def propose(model: str, path: Path | None, prompt_p99: float, output_p99: float, in_flight_p95: float, available: int) -> Proposal:
    """`available`: the bytes this model may take (what is free plus what it holds now)."""
    need = prompt_p99 + output_p99
    ctx = max(MIN_CTX, math.ceil(need * CTX_ROOM / CTX_STEP) * CTX_STEP)
    info = read_model_info(path) if path is not None and path.exists() else None
    lines = [f"prompt p99 {prompt_p99:,.0f} + answer p99 {output_p99:,.0f} = {need:,.0f} tokens, +{CTX_ROOM - 1:.0%} room, "
             f"rounded up to {CTX_STEP}: --ctx {ctx}"]
    if info is not None and info.context_length and ctx > info.context_length:
        ctx = info.context_length
        lines.append(f"the model was trained on {ctx:,} tokens: --ctx {ctx}")
    parallel = max(1, math.ceil(in_flight_p95))
    lines.append(f"requests in flight as one arrived, p95 {in_flight_p95:.1f}: --parallel {parallel}")
    kv_type = None
    if info is None:
        lines.append("the model's file is not on this machine: no memory plan (run tune where the server runs)")
        return Proposal(model, ctx, parallel, KVType.F16.value, lines)
    for kind in KVType:
        plan = planner.plan_for(info, ctx, parallel, kind, available=available)
        lines.append(f"{kind.value}: weights {_mib(plan.weights)} + KV {_mib(plan.kv_cache)} ({ctx:,} x {parallel} tokens) + compute "
                     f"{_mib(plan.compute)} = {_mib(plan.total)} of {_mib(int(available * planner.headroom()))} usable"
                     + (": fits" if plan.fits else ": does not fit"))
        if plan.fits:
            kv_type = kind.value
            break
    if kv_type is None:
        lines.append("no KV type fits: fewer sequences or a smaller context (the longest requests will be refused)")
    return Proposal(model, ctx, parallel, kv_type, lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"
