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
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench_serve(url: str, concurrency: int, n_requests: int, max_tokens: int, seed: int, api_key: str | None, as_json: bool) -> None:
    """Load a server with streaming chat requests; report TTFT, TPOT, end-to-end latency and tok/s."""
    import httpx

    from edgechat.errors import EdgechatError
    from edgechat.loadgen import run_load

    try:
        report = asyncio.run(run_load(url, concurrency, n_requests, max_tokens, seed, api_key=api_key))
    except httpx.HTTPError as exc:
        raise EdgechatError(f"cannot reach {url}: {exc}") from None
    click.echo(report.to_json() if as_json else report.table())
    if report.ok == 0:
        raise SystemExit(1)


def register(cli: click.Group) -> None:
    cli.add_command(bench_group)
