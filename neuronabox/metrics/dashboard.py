"""The Grafana dashboard (``dashboards/neuronabox.json``) read back: its panels, queries and a text outline."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

from .scrape import DASHBOARD

__all__ = ["load_dashboard", "panel_queries", "metric_names", "describe_dashboard"]

_METRIC = re.compile(r"\b(nbox_[a-z0-9_]+)\b")


def load_dashboard(path: str | Path | None = None) -> dict[str, Any]:
    """The dashboard JSON as a dict."""
    return json.loads(Path(path or DASHBOARD).read_text(encoding="utf-8"))


def panel_queries(dash: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Every (panel, target) pair that holds a PromQL expression, rows' nested panels included."""
    for p in dash.get("panels", []):
        for q in [p] + list(p.get("panels", [])):
            for t in q.get("targets", []) or []:
                if t.get("expr"):
                    yield q, t


def metric_names(expr: str) -> set[str]:
    """The ``nbox_*`` metric names an expression reads (histogram suffixes kept)."""
    return set(_METRIC.findall(expr))


def describe_dashboard(dash: dict[str, Any] | None = None) -> str:
    """A plain-text outline (rows, panels, units, queries): what a user sees, for reviews and the docs."""
    dash = dash or load_dashboard()
    lines = [f"{dash['title']} (uid {dash['uid']}, refresh {dash.get('refresh')}, last {dash['time']['from']})"]
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        lines.append(f"  variable ${v['name']} ({v['type']}): {q}")
    for p in dash.get("panels", []):
        if p["type"] == "row":
            lines.append(f"\n== {p['title']} ==")
            continue
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        g = p["gridPos"]
        where = f"{g['w']}x{g['h']} at x={g['x']},y={g['y']}" + (f", {unit}" if unit else "")
        lines.append(f"  [{p['type']}, {where}] {p['title']}")
        for t in p.get("targets", []):
            legend = t.get("legendFormat", "")
            legend = "" if legend in ("", "__auto") else f"  legend {legend!r}"
            lines.append(f"      {t['refId']}: {t['expr']}{legend}")
    return "\n".join(lines)
