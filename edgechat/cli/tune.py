"""`edgechat tune --url URL`: the flags a running server should be restarted with, from the
traffic it saw (its /metrics histograms) and the memory there is (its /health), with the
arithmetic behind each."""

from __future__ import annotations

from pathlib import Path

import click

from edgechat.cli.models import DEFAULT_URL, server_get, server_models
from edgechat.errors import EdgechatError


@click.command("tune")
@click.option("--url", default=DEFAULT_URL, show_default=True, help="The edgechat server whose traffic to read.")
@click.option("--api-key", default=None, envvar="EDGECHAT_API_KEY", help="Its API key, if it has one (env: EDGECHAT_API_KEY).")
def tune_cmd(url: str, api_key: str | None) -> None:
    """Propose --ctx, --parallel and --kv-type for each model from the P99 of its prompt and
    answer lengths and the requests in flight, checked against the memory free."""
    from edgechat.scrape import histograms
    from edgechat.tune import propose

    cards = {c["id"]: c for c in server_models(url, api_key)}
    memory = server_get(url, api_key, "/health").json().get("memory") or {}
    tails = histograms(server_get(url, api_key, "/metrics").text)
    prompts = tails.get("edgechat_request_prompt_tokens", {})
    if not any(count for count, _ in prompts.values()):
        raise EdgechatError(f"the server at {url} has answered no request yet: tune reads the traffic it saw; send some first")
    for model, (count, (_, _, prompt_p99)) in sorted(prompts.items()):
        if not count:
            continue
        _, (_, _, output_p99) = tails["edgechat_request_output_tokens"][model]
        _, (_, in_flight_p95, _) = tails.get("edgechat_requests_in_flight", {}).get(model, (0, [1.0, 1.0, 1.0]))
        meta = (cards.get(model) or {}).get("meta") or {}
        holds = meta.get("memory_bytes") or 0 if meta.get("state", "loaded") == "loaded" else 0
        path = Path(meta["path"]) if meta.get("path") else None
        proposal = propose(model, path, prompt_p99 or 0, output_p99 or 0, in_flight_p95 or 1.0, int(memory.get("available", 0)) + holds)
        click.echo(f"{model} ({count} requests):")
        for line in proposal.lines:
            click.echo(f"  {line}")
        click.echo(f"  edgechat serve -m {model} {proposal.flags()}\n")


def register(cli: click.Group) -> None:
    cli.add_command(tune_cmd)
