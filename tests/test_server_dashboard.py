"""The Grafana dashboard in packaging/ plots only what the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from edgechat.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).parent.parent / "packaging" / "grafana-edgechat.json"


def test_every_dashboard_query_names_a_metric_the_server_exports():
    metrics = ServerMetrics()
    metrics.add_model("some-model", ["default"])  # what create_app does for each served model
    exported = {s.name for family in metrics.registry.collect() for s in family.samples}
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queried = {name for p in panels for t in p["targets"] for name in re.findall(r"\bedgechat_\w+", t["expr"])}
    assert queried and queried <= exported, queried - exported
    # the latency percentiles the issue asks for: TTFT, TPOT, end to end and queue time
    for name in ("time_to_first_token", "time_per_output_token", "request_duration", "queue_wait"):
        assert f"edgechat_{name}_seconds_bucket" in queried
