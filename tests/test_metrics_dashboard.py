"""The scrape configuration and Grafana files as rendered, and the dashboard's structure (no servers)."""

from __future__ import annotations

import re
import shutil
import subprocess

import jinja2
import pytest
import yaml

from neuronabox.metrics.dashboard import describe_dashboard, load_dashboard, metric_names, panel_queries
from neuronabox.metrics.scrape import (
    GRAFANA_DATASOURCE_TEMPLATE,
    PROMETHEUS_TEMPLATE,
    render_grafana_provisioning,
    render_scrape_config,
    render_template,
    scrape_target,
)

TARGETS = [
    scrape_target("nbox-rank", ["127.0.0.1:9464"], run="r-1", real_rank=0),
    {"job": "nbox-agent", "targets": ["10.0.0.1:9100", "10.0.0.2:9100"], "labels": {"cluster": "ignored", "role": "agent"}},
]

# Every metric the real rank's exporter or the shaping agent exports (docs/guide/metrics.md).
EXPORTED = {
    "nbox_info", "nbox_emulated_world_size",
    "nbox_iteration_duration_seconds_bucket", "nbox_iteration_duration_seconds_sum", "nbox_iteration_duration_seconds_count",
    "nbox_collective_duration_seconds_bucket", "nbox_collective_duration_seconds_sum",
    "nbox_collective_duration_seconds_count", "nbox_collective_bytes_total", "nbox_collectives_total",
    "nbox_exposed_communication_seconds_total", "nbox_process_cpu_seconds_total", "nbox_process_resident_memory_bytes",
    "nbox_gpu_utilization_ratio", "nbox_gpu_memory_used_bytes", "nbox_gpu_memory_total_bytes", "nbox_gpu_process_memory_bytes",
    "nbox_link_transmit_bytes_total", "nbox_link_transmit_packets_total", "nbox_link_drops_total",
    "nbox_link_rate_bytes_per_second", "nbox_link_delay_seconds", "nbox_link_jitter_seconds", "nbox_link_loss_ratio",
    "nbox_relay_connections_total", "nbox_relay_bytes_total",
}


def test_scrape_config_renders_targets_with_cluster_labels():
    cfg = yaml.safe_load(render_scrape_config("demo", TARGETS, "2s"))
    assert cfg["global"]["scrape_interval"] == "2s"
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"nbox-rank", "nbox-agent"}
    rank = jobs["nbox-rank"]
    assert rank["honor_labels"] is True  # the exporter's own cluster/run labels win
    assert rank["static_configs"] == [{"targets": ["127.0.0.1:9464"], "labels": {"cluster": "demo", "real_rank": "0", "run": "r-1"}}]
    agent = jobs["nbox-agent"]["static_configs"][0]
    assert agent["targets"] == ["10.0.0.1:9100", "10.0.0.2:9100"]
    assert agent["labels"] == {"cluster": "demo", "role": "agent"}  # the cluster comes from cluster_name


def test_scrape_config_with_no_targets_is_still_valid_yaml():
    assert yaml.safe_load(render_scrape_config("demo", []))["scrape_configs"] == []


def test_a_missing_context_key_is_an_error_not_a_blank():
    with pytest.raises(jinja2.UndefinedError):
        render_template(PROMETHEUS_TEMPLATE, {"cluster_name": "x", "scrape_targets": []})
    with pytest.raises(jinja2.UndefinedError):
        render_template(GRAFANA_DATASOURCE_TEMPLATE, {"cluster_name": "x", "scrape_interval": "5s", "scrape_targets": []})


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool is not installed (Debian package prometheus)")
def test_promtool_accepts_the_rendered_configuration(tmp_path):
    p = tmp_path / "prometheus.yml"
    p.write_text(render_scrape_config("demo", TARGETS, "5s"))
    r = subprocess.run(["promtool", "check", "config", str(p)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_provisioning_renders():
    files = render_grafana_provisioning("demo", TARGETS, prometheus_port=9091, scrape_interval="5s")
    assert set(files) == {"datasources/prometheus.yml", "dashboards/neuronabox.yml"}
    ds = yaml.safe_load(files["datasources/prometheus.yml"])
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9091"
    assert source["jsonData"]["timeInterval"] == "5s" and ds["apiVersion"] == 1
    prov = yaml.safe_load(files["dashboards/neuronabox.yml"])
    assert prov["providers"][0]["type"] == "file" and prov["providers"][0]["options"]["path"]
    custom = render_grafana_provisioning("demo", [], 9090, prometheus_host="prom", dashboards_path="/d")
    assert "http://prom:9090" in custom["datasources/prometheus.yml"] and '"/d"' in custom["dashboards/neuronabox.yml"]


# ---- the dashboard --------------------------------------------------------------------------------
def test_dashboard_structure():
    d = load_dashboard()
    assert d["uid"] == "neuronabox" and d["title"] and d["schemaVersion"] >= 36 and d.get("id") is None
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("cluster", "run"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p.get("description"), f"panel {p['title']!r} has no description"
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)) and refs, p["title"]


def test_every_query_reads_exported_metrics_and_honors_the_variables():
    d = load_dashboard()
    seen: set[str] = set()
    for panel, t in panel_queries(d):
        expr = t["expr"]
        names = metric_names(expr)
        assert names and names <= EXPORTED, f"{panel['title']}: unknown metrics {names - EXPORTED}"
        seen |= names
        # Every selector filters by cluster; the real rank's metrics by run too (the agent has no run).
        for sel in re.findall(r"(nbox_[a-z0-9_]+)\{([^}]*)\}", expr):
            assert 'cluster=~"$cluster"' in sel[1], f"{panel['title']}: {sel}"
            if not sel[0].startswith(("nbox_link_", "nbox_relay_")):
                assert 'run=~"$run"' in sel[1], f"{panel['title']}: {sel}"
        assert "$__rate_interval" in expr or "rate(" not in expr, f"{panel['title']}: fixed rate window"
    # Every exported metric family shows up somewhere on the dashboard.
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in EXPORTED}
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in seen}
    assert families <= shown, families - shown


def test_dashboard_outline_names_every_panel():
    text = describe_dashboard()
    for p in load_dashboard()["panels"]:
        assert p["title"] in text
