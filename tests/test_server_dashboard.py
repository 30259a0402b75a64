"""The Grafana dashboard in packaging/ plots only what the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from edgechat.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).parent.parent / "packaging" / "grafana-edgechat.json"
LATENCIES = ("time_to_first_token", "time_per_output_token", "request_duration", "queue_wait")
CLASS = "interactive"


def _exported() -> dict[str, set[str]]:
    """Each sample name the server exports -> its label names, as a server with a priority class
    writes them at a scrape."""
    metrics = ServerMetrics()
    metrics.add_model("some-model", [CLASS])  # what create_app does for each served model
    metrics.render({}, False, {CLASS: {"running": 1, "waiting": 0, "share": 1}})
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def _queries(dashboard: dict) -> list[str]:
    panels = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return panels + [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_every_dashboard_query_names_a_metric_the_server_exports():
    exported = _exported()
    queried = {name for q in _queries(json.loads(DASHBOARD.read_text())) for name in re.findall(r"\bedgechat_\w+", q)}
    assert queried and queried <= set(exported), queried - set(exported)
    # the latency percentiles the issue asks for: TTFT, TPOT, end to end and queue time
    for name in LATENCIES:
        assert f"edgechat_{name}_seconds_bucket" in queried


def test_latency_panels_split_by_model_and_the_exported_class_label():
    exported = _exported()
    # the label the server puts a request's priority class in: the one whose value is the class
    metrics = ServerMetrics()
    metrics.add_model("some-model", [CLASS])
    [class_label] = {k for f in metrics.registry.collect() for s in f.samples for k, v in s.labels.items() if v == CLASS}
    dashboard = json.loads(DASHBOARD.read_text())
    for name in LATENCIES:
        bucket = f"edgechat_{name}_seconds_bucket"
        targets = [t for p in dashboard["panels"] for t in p["targets"] if bucket in t["expr"]]
        assert sorted(re.search(r"histogram_quantile\(([\d.]+),", t["expr"])[1] for t in targets) == ["0.5", "0.95", "0.99"], name
        for t in targets:
            [grouped] = re.findall(r"sum by \(([^)]*)\)", t["expr"])
            labels = {x.strip() for x in grouped.split(",")}
            assert {"le", "model", class_label} <= labels <= exported[bucket], (name, labels)
            # filters and legends name only labels the series keep
            assert set(re.findall(r"(\w+)=~", t["expr"])) <= exported[bucket]
            assert set(re.findall(r"\{\{(\w+)\}\}", t["legendFormat"])) <= labels
    # the class picker lists the values of that same label
    [picker] = [v for v in dashboard["templating"]["list"] if v["name"] == class_label]
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", picker["query"]).groups()
    assert label == class_label and class_label in exported[metric]
