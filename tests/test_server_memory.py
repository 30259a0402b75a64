"""Memory and traffic tails, watched while serving, on the embedded model: /metrics and /health
carry this process's RSS (checked against /proc), the machine's MemAvailable and the memory
cgroup's usage; per-request prompt and output token histograms and rejections by reason; and
`edgechat ps` shows them as a user reads them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from edgechat import sysmem
from edgechat.cli.models import ps_cmd
from edgechat.engine import Engine, EngineConfig
from edgechat.engine.types.request import ChatRequest
from edgechat.scrape import histograms, quantile
from edgechat.server import create_app
from edgechat.server.settings import ServerSettings
from tests.serving import serving

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine(models_root):
    eng = Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=2, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def url(engine):
    with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), engine)) as base:
        yield base


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def test_metrics_and_health_carry_the_memory_read_from_proc(url):
    samples = _samples(httpx.get(f"{url}/metrics").text)
    rss = samples[("edgechat_process_resident_bytes", ())]
    assert abs(rss - _status_kib("VmRSS")) < 0.1 * rss  # the server runs in this process
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()}
    assert abs(samples[("edgechat_memory_available_bytes", ())] - meminfo["MemAvailable"]) < 0.1 * meminfo["MemAvailable"]
    files = sysmem.cgroup_files()
    if files is not None:  # this machine's memory cgroup: its usage, as the file says
        usage = int(files[1].read_text())
        assert abs(samples[("edgechat_cgroup_memory_usage_bytes", ())] - usage) < 0.2 * usage
    health = httpx.get(f"{url}/health").json()["memory"]
    assert abs(health["rss"] - rss) < 0.1 * rss and health["available"] > 0


def test_prompt_and_output_lengths_and_rejections_are_counted_per_model(url, engine):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompts = ["Hi", "Tell me about the sea. " * 10, "Name three colours."]
    for text in prompts:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=5, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 600}])
    text = httpx.get(f"{url}/metrics").text
    samples = _samples(text)
    label = (("model", MODEL), ("priority", "default"))
    assert samples[("edgechat_request_prompt_tokens_count", label)] == 3
    lengths = [engine.count_tokens(ChatRequest(messages=[{"role": "user", "content": t}])) for t in prompts]
    assert samples[("edgechat_request_prompt_tokens_sum", label)] == sum(lengths)
    assert samples[("edgechat_request_output_tokens_sum", label)] == 15  # 5 each: max_tokens
    assert samples[("edgechat_rejections_total", (("reason", "context_length_exceeded"),))] == 1
    count, (p50, p95, p99) = histograms(text)["edgechat_request_prompt_tokens"][MODEL]
    assert count == 3 and sorted(lengths)[1] <= 2 * p50 and p99 >= p95 >= p50


def test_ps_shows_memory_and_the_tails(url):
    out = CliRunner().invoke(ps_cmd, ["--url", url])
    assert out.exit_code == 0, out.output
    assert "memory: server " in out.output and " resident, " in out.output
    assert "requests (p50 / p95 / p99):" in out.output and MODEL in out.output.split("requests")[1]


def test_a_quantile_interpolates_inside_its_bucket():
    buckets = [(1.0, 10.0), (2.0, 20.0), (4.0, 30.0), (float("inf"), 30.0)]
    assert quantile(0.5, buckets) == 1.5 and quantile(0.99, buckets) == pytest.approx(3.94)
    assert quantile(0.5, []) is None


def test_cgroup_files_are_found_in_either_hierarchy(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "app.slice").mkdir(parents=True)
    (v2 / "app.slice" / "memory.max").write_text("max\n")
    (v2 / "app.slice" / "memory.current").write_text("1234\n")
    (tmp_path / "cgroup2").write_text("0::/app.slice\n")
    assert sysmem.cgroup_files(v2, tmp_path / "cgroup2") == (v2 / "app.slice" / "memory.max", v2 / "app.slice" / "memory.current")
    v1 = tmp_path / "v1"
    (v1 / "memory" / "box").mkdir(parents=True)
    (v1 / "memory" / "box" / "memory.limit_in_bytes").write_text("536870912\n")
    (v1 / "memory" / "box" / "memory.usage_in_bytes").write_text("1000\n")
    (tmp_path / "cgroup1").write_text("5:cpu:/\n4:memory:/box\n0::/\n")
    limit, usage = sysmem.cgroup_files(v1, tmp_path / "cgroup1")
    assert limit.read_text().strip() == "536870912" and usage.name == "memory.usage_in_bytes"


def test_tune_proposes_flags_from_the_traffic_seen_with_its_arithmetic(url):
    import math

    from edgechat.cli.tune import tune_cmd

    httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4})
    tails = histograms(httpx.get(f"{url}/metrics").text)
    _, (_, _, prompt_p99) = tails["edgechat_request_prompt_tokens"][MODEL]
    _, (_, _, output_p99) = tails["edgechat_request_output_tokens"][MODEL]
    out = CliRunner().invoke(tune_cmd, ["--url", url])
    assert out.exit_code == 0, out.output
    ctx = max(512, math.ceil((prompt_p99 + output_p99) * 1.10 / 256) * 256)
    assert f"prompt p99 {prompt_p99:,.0f} + answer p99 {output_p99:,.0f}" in out.output
    assert f"edgechat serve -m {MODEL} --ctx {ctx} --parallel 1 --kv-type f16" in out.output  # one request at a time here
    assert "f16: weights " in out.output and ": fits" in out.output


def test_tune_on_a_server_without_traffic_says_so(engine):
    from edgechat.cli.tune import tune_cmd

    with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), engine)) as fresh:
        out = CliRunner().invoke(tune_cmd, ["--url", fresh])
    assert "has answered no request yet" in str(out.exception)  # run_guarded prints it as one line
