"""`edgechat bench ...`: measurements a user can run against their own setup."""

from __future__ import annotations

import asyncio

import click


@click.group("bench")
def bench_group() -> None:
    """Benchmarks."""


@bench_group.command("serve")
@click.option("--url", required=True, help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True, help="Requests in flight at once.")
@click.option("--requests", "n_requests", type=click.IntRange(min=1), default=16, show_default=True, help="Requests to send in all.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="Output tokens per request (end of text is ignored).")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same prompts.")
@click.option("--api-key", default=None, envvar="EDGECHAT_API_KEY", help="Bearer key for the server.")
@click.option("--trace", default=None, metavar="MIX|FILE",
              help="Replay traffic instead: a shipped mix (chat, agents, document) or a JSONL file of {at, max_tokens, prompt | tokens, group}.")
@click.option("--slo-ttft", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True, help="With --trace: the TTFT goodput counts (s).")
@click.option("--slo-tpot", type=click.FloatRange(min=0, min_open=True), default=0.2, show_default=True, help="With --trace: the TPOT goodput counts (s).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench_serve(url: str, concurrency: int, n_requests: int, max_tokens: int, seed: int, api_key: str | None, trace: str | None,
                slo_ttft: float, slo_tpot: float, as_json: bool) -> None:
    """Load a server with streaming chat requests; report TTFT, TPOT, end-to-end latency and tok/s.
    With --trace, replay timed traffic and report its tails, goodput and errors by kind."""
    import httpx

    from edgechat.errors import EdgechatError, UsageError
    from edgechat.loadgen import MIXES, mix, read_trace, replay, run_load

    try:
        if trace is not None:
            try:
                entries = mix(trace, seed) if trace in MIXES else read_trace(trace)
            except (ValueError, OSError) as exc:
                raise UsageError(str(exc) if isinstance(exc, ValueError) else f"cannot read {trace}: {exc.strerror}") from None
            with click.progressbar(length=len(entries), label="requests", file=click.get_text_stream("stderr")) as bar:
                report = asyncio.run(replay(url, entries, seed, api_key, slo_ttft=slo_ttft, slo_tpot=slo_tpot,
                                            progress=lambda done, total: bar.update(1)))
        else:
            report = asyncio.run(run_load(url, concurrency, n_requests, max_tokens, seed, api_key=api_key))
    except httpx.HTTPError as exc:
        raise EdgechatError(f"cannot reach {url}: {exc}") from None
    click.echo(report.to_json() if as_json else report.table())
    if report.ok == 0:
        raise SystemExit(1)


def register(cli: click.Group) -> None:
    cli.add_command(bench_group)
