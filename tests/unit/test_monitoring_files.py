"""deploy/grafana and the KEDA ScaledObject: they parse, and every gpuq metric and label they query is one
that gpuq's /metrics registry has (so a renamed metric breaks this test, not an operator's dashboard)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.metrics import MetricWrapperBase

from gpuq import metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "gpuq-dashboard.json"
SCALED_OBJECT = DEPLOY / "k8s" / "agent-scaledobject.yaml"

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}
SELECTOR = re.compile(r"\b(gpuq_\w+)\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"")


def sample_names() -> dict[str, str]:
    """Every sample name /metrics can carry -> its family's name."""
    return {f.name + suffix: f.name for f in metrics.REGISTRY.collect() for suffix in SUFFIXES[f.type]}


def label_names() -> dict[str, set[str]]:
    """Family name -> its label names (histograms add ``le``)."""
    out = {"gpuq_pending_jobs": set(metrics.BACKLOG_LABELS), "gpuq_pending_oldest_seconds": set(metrics.BACKLOG_LABELS),
           "gpuq_slot_gap_seconds": {"le"}, "gpuq_slot_busy_seconds": set()}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            extra = {"le"} if value._type == "histogram" else set()
            out[value._name.removesuffix("_total")] = set(value._labelnames) | extra
    return out


def check_expression(expr: str) -> set[str]:
    """The gpuq sample names ``expr`` selects; fails on a name or a label matcher /metrics lacks."""
    names, labels = sample_names(), label_names()
    used = set()
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    for name, matchers in SELECTOR.findall(expr):
        assert name in names, f"{name} is not on gpuq's /metrics: {expr}"
        used.add(name)
        for label in MATCHER.findall(matchers):
            assert label in labels[names[name]], f"{name} has no label {label}: {expr}"
    return used


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def test_the_grafana_dashboard_queries_only_what_gpuq_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    used: set[str] = set()
    for p in panels(dashboard):
        if p["type"] == "row":
            continue
        assert p["targets"] and {"h", "w", "x", "y"} <= set(p["gridPos"]), p["title"]
        for target in p["targets"]:
            found = check_expression(target["expr"])
            assert found, f"{p['title']}: {target['expr']} reads no gpuq metric"
            used |= found
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            used |= check_expression(variable["definition"])
    # What the dashboard is for: the backlog per shape, busy fraction, slot gaps, lease latency, devices.
    assert {"gpuq_pending_jobs", "gpuq_pending_oldest_seconds", "gpuq_queue_depth", "gpuq_jobs_inflight_by_kind",
            "gpuq_slot_busy_seconds_total", "gpuq_slot_gap_seconds_sum", "gpuq_slot_gap_seconds_bucket",
            "gpuq_lease_query_seconds_bucket", "gpuq_agent_device_utilization_ratio",
            "gpuq_agent_device_memory_used_bytes"} <= used


def test_a_misspelt_metric_or_label_is_caught() -> None:
    for bad in ('sum(gpuq_pending_job{kind="a"})', 'gpuq_pending_jobs{gpu="1"}', "rate(gpuq_jobs_completed[5m])"):
        try:
            check_expression(bad)
        except AssertionError:
            continue
        raise AssertionError(f"not caught: {bad}")


def test_the_scaled_object_scales_the_agent_deployment_on_gpuq_metrics() -> None:
    [scaled] = list(yaml.safe_load_all(SCALED_OBJECT.read_text()))
    [agent] = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "agent-deployment.yaml").read_text())
               if d["kind"] == "Deployment"]
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == agent["metadata"]["name"]
    assert spec["minReplicaCount"] == 0 < spec["maxReplicaCount"]
    env = {e["name"]: e.get("value") for e in agent["spec"]["template"]["spec"]["containers"][0]["env"]}
    kinds = "|".join(env["GPUQ_KINDS"].split(","))
    work, wait = spec["triggers"]
    for trigger in (work, wait):
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        check_expression(query)
        assert f'kind=~"{kinds}"' in query, "the query selects the kinds the agents take"
    assert check_expression(work["metadata"]["query"]) == {"gpuq_pending_jobs", "gpuq_kind_paused",
                                                           "gpuq_jobs_inflight_by_kind"}
    assert work["metricType"] == "AverageValue" and work["metadata"]["threshold"] == env["GPUQ_CAPACITY"]
    assert check_expression(wait["metadata"]["query"]) == {"gpuq_pending_oldest_seconds", "gpuq_kind_paused"}
    # Agents finish their jobs on SIGTERM: scaling down must leave them the time.
    assert agent["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
