"""infra/monitoring: Prometheus' own promtool accepts the scrape config and the alert rules, and every
query of the Grafana dashboard is valid PromQL (checked as recording rules) on the metrics Triton
exports. That the series exist on a real Triton is tested in tests/integration/test_serving.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parents[2] / "infra" / "monitoring"
PROMTOOL = "/usr/bin/promtool"  # Debian's prometheus package (infra/local/test-tools.sh)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_scrape_config_and_the_alert_rules():
    checked = promtool("check", "config", str(MONITORING / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = promtool("check", "rules", str(MONITORING / "alerts.yml"))
    assert rules.returncode == 0 and "4 rules found" in rules.stdout, rules.stdout + rules.stderr


def test_every_dashboard_query_is_valid_promql(tmp_path):
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"].replace("$model", ".*") for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 6
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    (tmp_path / "dashboard-rules.yml").write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", str(tmp_path / "dashboard-rules.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_dashboard_compares_served_versions_side_by_side():
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    model = next(v for v in dashboard["templating"]["list"] if v["name"] == "model")
    assert model["multi"] and model["includeAll"]  # champion and challenger together
    per_version = [t for p in dashboard["panels"] for t in p["targets"] if "by (model)" in t["expr"]]
    assert all("{{model}}" in t["legendFormat"] for t in per_version) and len(per_version) >= 5


def test_the_gateways_per_client_counters_are_scraped_and_shown():
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    gateway = next(job for job in scrape["scrape_configs"] if job["job_name"] == "llmops-gateway")
    assert gateway["metrics_path"] == "/metrics" and gateway["static_configs"][0]["targets"] == ["127.0.0.1:8082"]
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    assert "by (client, status) (rate(llmops_gateway_requests_total" in exprs
    assert "by (client) (rate(llmops_gateway_tokens_total" in exprs
