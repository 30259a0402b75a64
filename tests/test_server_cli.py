"""`edgechat serve` as a process and `edgechat bench serve` against it."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from click.testing import CliRunner
from tiny_mmproj import CHECKS, GRADIENT

from edgechat.cli import cli
from edgechat.cli.serve import _is_loopback
from edgechat.engine.runners.media import VISION_MODEL

pytestmark = pytest.mark.slow


def test_only_loopback_addresses_count_as_private():
    assert all(_is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.1.2.3"))
    assert not any(_is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "example.org"))


def test_serve_command_serves_authenticates_and_stops_cleanly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "checks.png").write_bytes(CHECKS)  # 126 bytes
    cmd = [sys.executable, "-m", "edgechat", "serve", "--port", str(port), "--parallel", "2", "--ctx", "512", "--api-key", "k1",
           "--flash-attn", "off", "--max-messages", "4", "--image-dir", str(tmp_path / "pics"), "--max-images", "1",
           "--max-image-mib", "0.001"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"]
        out = client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert out.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}] * 5, max_tokens=3)
        assert info.value.code == "too_many_messages"
        # the image options reach the server: a file in --image-dir is read (then this text-only
        # model refuses it), a second image or a bigger one is refused by the limits given
        def ask(*urls):
            content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": content}], max_tokens=3)
            return info.value
        inside = (tmp_path / "pics" / "checks.png").as_uri()
        assert VISION_MODEL in ask(inside).message
        assert ask(inside, inside).code == "too_many_images"
        assert ask("data:image/png;base64," + base64.b64encode(GRADIENT).decode()).code == "image_too_large"

        result = CliRunner().invoke(
            cli, ["bench", "serve", "--url", url, "--api-key", "k1", "--concurrency", "2", "--requests", "4", "--max-tokens", "4", "--json"]
        )
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["ok"] == 4 and report["failed"] == 0 and report["model"] == "smollm2-135m-instruct"
        # ignore_eos makes every answer exactly max_tokens long
        assert report["output_tokens"] == 16
        assert 0 < report["ttft"]["p50"] <= report["ttft"]["p99"] <= report["e2e"]["p99"]
        assert report["output_tok_s"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert "serving smollm2" in output.lower() and "other machines can reach" not in output


def test_bench_serve_reports_an_unreachable_server_in_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(cli, ["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--requests", "1"])
    assert result.exit_code != 0
    assert "cannot reach" in str(result.exception) or "cannot reach" in result.output
