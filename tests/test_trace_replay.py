"""Replayed traffic (`edgechat bench serve --trace`): a JSONL trace or a shipped mix sent at its
times against `edgechat serve` and llama.cpp's `llama-server` on the embedded model; the report's
tails, goodput and errors by kind; bad trace lines named in one line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from edgechat.engine import Engine, EngineConfig
from edgechat.loadgen import TraceEntry, _text, mix, read_trace, replay
from edgechat.server import create_app
from edgechat.server.settings import ServerSettings
from tests.serving import serving

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
#: two sessions sharing a prefix, a short chat, and one prompt longer than the 1,024-token context
TRACE = [
    {"at": 0.0, "tokens": 300, "group": "session-0", "max_tokens": 8},
    {"at": 0.2, "prompt": "Name a colour.", "max_tokens": 8},
    {"at": 0.5, "tokens": 340, "group": "session-0", "max_tokens": 8},
    {"at": 0.6, "tokens": 300, "group": "session-1", "max_tokens": 8},
    {"at": 1.0, "tokens": 3000, "max_tokens": 8},
]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in TRACE))
    return path


@pytest.fixture(scope="module")
def edgechat_url(models_root):
    engine = Engine(EngineConfig(model=MODEL, n_ctx=1024, n_parallel=2, paths=models_root))
    try:
        with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), engine)) as url:
            yield url
    finally:
        engine.close()


def test_a_group_shares_its_beginning_and_a_later_turn_extends_an_earlier_one():
    entries = read_trace_entries(TRACE)
    first, later, other = _text(entries[0], 0, 0), _text(entries[2], 2, 0), _text(entries[3], 3, 0)
    assert later.startswith(first) and len(later) > len(first)
    assert other[:200] == first[:200]  # sessions of one agent: the same prefix
    agents = mix("agents")
    assert len(agents) == 18 and {e.group for e in agents} == {"session-0", "session-1", "session-2"}
    document = mix("document")
    assert max(e.tokens for e in document) == 16_000 and sum(e.tokens == 16_000 for e in document) == 1


def read_trace_entries(raw: list[dict]) -> list[TraceEntry]:
    return [TraceEntry(e["at"], e["max_tokens"], e.get("prompt"), e.get("tokens", 0), e.get("group")) for e in raw]


def test_the_trace_replays_against_edgechat_with_tails_goodput_and_errors(edgechat_url, trace_file):
    entries = read_trace(str(trace_file))
    seen: list[int] = []
    report = asyncio.run(replay(edgechat_url, entries, slo_ttft=30.0, slo_tpot=5.0, progress=lambda done, total: seen.append(done)))
    assert report.requests == 5 and report.ok == 4 and report.errors == {"HTTP 400": 1}
    assert seen == [1, 2, 3, 4, 5]
    assert report.goodput_share == pytest.approx(0.8) and report.ttft["p99"] >= report.ttft["p50"] > 0
    assert report.duration_s >= 1.0  # the last entry was sent at its time
    # by kind: the three session turns, and the one ungrouped chat that was answered
    assert {kind: tails["ok"] for kind, tails in report.kinds.items()} == {"session": 3, "request": 1}
    assert report.kinds["session"]["ttft"]["p99"] > 0 and "session (3): TTFT" in report.table()


def test_the_same_trace_replays_against_llama_server(llama_tools, smollm2_path, tmp_path_factory, trace_file):
    from bench.bench_serve import _free_port, _server
    from quantize.llm import use_extra_buffers

    port = _free_port()
    cmd = [str(llama_tools / "llama-server"), "-m", str(smollm2_path), "-c", "2048", "-np", "2", "--no-webui", "--port", str(port),
           *([] if use_extra_buffers() else ["--no-repack"])]  # the engine's weight layout on this CPU (AMX may fault)
    with _server(cmd, port, "llama-server", tmp_path_factory.mktemp("llama-server")) as url:
        report = asyncio.run(replay(url, read_trace(str(trace_file)), slo_ttft=30.0, slo_tpot=5.0))
    assert report.requests == 5 and report.ok == 4 and list(report.errors) == ["HTTP 400"]


def test_the_command_reports_json_and_names_a_bad_line(edgechat_url, trace_file, tmp_path):
    run = subprocess.run([sys.executable, "-m", "edgechat", "bench", "serve", "--url", edgechat_url, "--trace", str(trace_file), "--json",
                          "--slo-ttft", "30"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["requests"] == 5 and report["errors"] == {"HTTP 400": 1} and report["slo"]["ttft_s"] == 30
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"at": 0, "tokens": 10}\n{"at": "soon"}\n')
    run = subprocess.run([sys.executable, "-m", "edgechat", "bench", "serve", "--url", edgechat_url, "--trace", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"{bad}:2: not a trace entry" in run.stderr and "Traceback" not in run.stderr
