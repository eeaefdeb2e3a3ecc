"""The alerting rules and the Grafana dashboard that ship with the plugin."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_fixtures import fetch

from rallypoint_prometheus.sink import PrometheusSink
from servers import PrometheusServer, require_binary

PLUGIN = Path(__file__).resolve().parents[1]  # the distribution
RULES = PLUGIN / "alerts" / "rallypoint.rules.yml"
DASHBOARD = PLUGIN / "grafana" / "rallypoint.json"
RULE_TESTS = Path(__file__).with_name("rallypoint.rules.test.yml")
ALERTS = {
    "RallypointRestartsClimbing",
    "RallypointWorldSizeBelowMin",
    "RallypointAgentsGone",
    "RallypointNodeLost",
    "RallypointWaitingForNodes",
    "RallypointRendezvousTooLong",
    "RallypointRendezvousSlow",
    "RallypointNoTrainingProgress",
    "RallypointGoodputLow",
    "RallypointRecoverySlow",
}
#: The metrics of the node's goodput account, each on the dashboard.
GOODPUT = {
    "rallypoint_goodput_ratio",
    "rallypoint_phase_seconds_total",
    "rallypoint_failure_detect_seconds_bucket",
    "rallypoint_recovery_seconds_bucket",
    "rallypoint_steps_redone_total",
    "rallypoint_failures_total",
    "rallypoint_stragglers_total",
}
#: Grafana's variables, as a query sees them once Grafana has filled them in.
GRAFANA = {"$run_id": ".*", "$__rate_interval": "1m", "$__range": "1h"}


def alert_rules() -> dict[str, dict[str, str]]:
    """Each alert's ``expr`` (and ``for`` where it has one), by name. The file is YAML, but
    simple enough to read without a YAML library: its exprs are plain one-liners or ``|``
    blocks."""
    lines = RULES.read_text().splitlines()
    rules: dict[str, dict[str, str]] = {}
    rule: dict[str, str] = {}
    for index, line in enumerate(lines):
        if match := re.match(r"^\s*- alert: (\w+)$", line):
            rule = rules.setdefault(match.group(1), {})
        elif match := re.match(r"^\s*for: (\S+)$", line):
            rule["for"] = match.group(1)
        elif match := re.match(r"^(\s*)expr: ?(.*)$", line):
            if match.group(2).strip() != "|":
                rule["expr"] = match.group(2).strip()
                continue
            block = []
            for following in lines[index + 1 :]:
                if following.strip() and len(following) - len(following.lstrip()) <= len(
                    match.group(1)
                ):
                    break
                block.append(following.strip())
            rule["expr"] = " ".join(block).strip()
    return rules


def rule_expressions() -> list[str]:
    """The expr of every rule."""
    return [rule["expr"] for rule in alert_rules().values()]


def dashboard_expressions() -> list[str]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    return exprs


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:rallypoint|test)_[a-z_]+\b", expr))


def test_rules_pass_promtool_check() -> None:
    promtool = require_binary("promtool", "prometheus")
    result = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_alerts_fire_when_they_should_and_only_then() -> None:
    promtool = require_binary("promtool", "prometheus")
    result = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == ALERTS == set(re.findall(r"alert: (\w+)", RULES.read_text()))


def test_dashboard_is_grafana_json_over_the_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "rallypoint" and dashboard["uid"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "run_id"}


def test_rules_and_dashboard_use_only_metrics_the_endpoint_serves(
    populated_sink: PrometheusSink,
) -> None:
    text = fetch(f"http://127.0.0.1:{populated_sink.port}/metrics")
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    used = set().union(*map(metric_names, rule_expressions() + dashboard_expressions()))
    assert {
        "rallypoint_restarts_total",
        "rallypoint_world_size",
        "rallypoint_training_step",
        "rallypoint_training_samples_total",
        "rallypoint_checkpoint_save_seconds_sum",
    } <= used
    assert set().union(*map(metric_names, dashboard_expressions())) >= GOODPUT
    assert used - served == set()


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_expression_is_valid_promql(
    source: str, prometheus_server_session: PrometheusServer
) -> None:
    exprs = rule_expressions() if source == "rules" else dashboard_expressions()
    assert len(exprs) == len(ALERTS) if source == "rules" else len(exprs) > 10
    for expr in exprs:
        for variable, value in GRAFANA.items():
            expr = expr.replace(variable, value)
        prometheus_server_session.query(expr)  # raises on a parse error
