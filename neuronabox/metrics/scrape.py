"""Prometheus scrape configuration and Grafana provisioning, rendered from ``compose-templates/``.

The compose renderer and these functions render the same template files with the same
context keys (``cluster_name``, ``scrape_interval``, ``scrape_targets`` and, for Grafana,
``prometheus_port``), so what the tests check is what ``nbox up --runtime docker`` mounts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = [
    "TEMPLATES",
    "DASHBOARD",
    "PROMETHEUS_TEMPLATE",
    "GRAFANA_DATASOURCE_TEMPLATE",
    "GRAFANA_DASHBOARDS_TEMPLATE",
    "render_template",
    "render_scrape_config",
    "render_grafana_provisioning",
    "scrape_target",
]

_ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = _ROOT / "compose-templates"
DASHBOARD = _ROOT / "dashboards" / "neuronabox.json"
PROMETHEUS_TEMPLATE = "prometheus.yml.j2"
GRAFANA_DATASOURCE_TEMPLATE = "grafana/provisioning/datasources/prometheus.yml.j2"
GRAFANA_DASHBOARDS_TEMPLATE = "grafana/provisioning/dashboards/neuronabox.yml.j2"


def render_template(name: str, context: Mapping[str, Any], templates: Path | None = None) -> str:
    """Render one template of ``compose-templates/`` with StrictUndefined (a missing key is an error, not a blank)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates or TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    return env.get_template(name).render(**context)


def scrape_target(job: str, targets: Iterable[str], **labels: Any) -> dict[str, Any]:
    """One entry of ``scrape_targets``: ``{"job", "targets": ["host:port"], "labels"}``."""
    return {"job": job, "targets": list(targets), "labels": {k: str(v) for k, v in labels.items()}}


def render_scrape_config(
    cluster_name: str, scrape_targets: Iterable[Mapping[str, Any]], scrape_interval: str = "5s"
) -> str:
    """The Prometheus configuration (YAML text) that scrapes ``scrape_targets`` for ``cluster_name``."""
    return render_template(
        PROMETHEUS_TEMPLATE,
        {"cluster_name": cluster_name, "scrape_interval": scrape_interval, "scrape_targets": list(scrape_targets)},
    )


def render_grafana_provisioning(
    cluster_name: str,
    scrape_targets: Iterable[Mapping[str, Any]],
    prometheus_port: int = 9090,
    scrape_interval: str = "5s",
    **extra: Any,
) -> dict[str, str]:
    """Grafana's provisioning files: relative path (under ``provisioning/``) -> YAML text."""
    ctx = {
        "cluster_name": cluster_name,
        "scrape_interval": scrape_interval,
        "scrape_targets": list(scrape_targets),
        "prometheus_port": prometheus_port,
        **extra,
    }
    prefix = "grafana/provisioning/"
    out = {}
    for name in (GRAFANA_DATASOURCE_TEMPLATE, GRAFANA_DASHBOARDS_TEMPLATE):
        out[name[len(prefix):].removesuffix(".j2")] = render_template(name, ctx)
    return out
