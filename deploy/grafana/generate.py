"""Writes LiveLoop's four Grafana dashboards (JSON, fixed uids) from the panel list in panels.py.

The dashboards are committed as JSON (what Grafana provisions and the Helm chart ships);
this script is how they are made, so that every panel has the same datasource variable,
layout and legend settings. Edit panels.py, then run:

    python deploy/grafana/generate.py           # rewrite deploy/grafana/dashboards/*.json
    python deploy/grafana/generate.py --check   # exit 1 if a committed file is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from panels import DASHBOARDS, DashboardSpec, PanelSpec

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE_UID = "liveloop-prometheus"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 41
GRID_WIDTH = 24


def _field_config(panel: PanelSpec) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.kind == "timeseries":
        defaults["custom"] = {"fillOpacity": 10, "lineWidth": 1, "showPoints": "never"}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.thresholds:
        steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
        steps += [{"color": color, "value": value} for value, color in panel.thresholds]
        defaults["thresholds"] = {"mode": "absolute", "steps": steps}
    return {"defaults": defaults, "overrides": []}


def _options(panel: PanelSpec) -> dict[str, Any]:
    if panel.kind == "timeseries":
        return {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if panel.kind == "bargauge":
        return {"orientation": "horizontal", "displayMode": "gradient", "reduceOptions": reduce}
    return {"colorMode": "value", "graphMode": "none", "reduceOptions": reduce}


def render_panel(panel: PanelSpec, panel_id: int, x: int, y: int) -> dict[str, Any]:
    """One panel's JSON at grid position (x, y)."""
    targets = []
    for i, (expr, legend) in enumerate(panel.queries):
        target: dict[str, Any] = {
            "datasource": DATASOURCE,
            "expr": expr,
            "legendFormat": legend,
            "refId": chr(ord("A") + i),
        }
        if panel.kind != "timeseries":
            target["instant"] = True
        targets.append(target)
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": _field_config(panel),
        "options": _options(panel),
        "targets": targets,
    }


def _variables() -> list[dict[str, Any]]:
    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {"text": "Prometheus", "value": DATASOURCE_UID},
            "hide": 0,
        }
    ]


def render_dashboard(spec: DashboardSpec) -> dict[str, Any]:
    """The dashboard's JSON: rows of panels laid out left to right, top to bottom."""
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row in spec.rows:
        panels.append(
            {
                "type": "row",
                "id": next_id,
                "title": row.title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
            }
        )
        next_id, y, x, row_height = next_id + 1, y + 1, 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, row_height = 0, y + row_height, 0
            panels.append(render_panel(panel, next_id, x, y))
            next_id, x, row_height = next_id + 1, x + panel.width, max(row_height, panel.height)
        y += row_height
    return {
        "uid": spec.uid,
        "title": spec.title,
        "description": spec.description,
        "tags": ["liveloop"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [
            {
                "title": "LiveLoop",
                "type": "dashboards",
                "tags": ["liveloop"],
                "asDropdown": True,
                "icon": "external link",
                "includeVars": False,
                "keepTime": True,
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "templating": {"list": _variables()},
        "panels": panels,
    }


def rendered() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        f"{spec.slug}.json": json.dumps(render_dashboard(spec), indent=2) + "\n"
        for spec in DASHBOARDS
    }


def main(argv: list[str] | None = None) -> int:
    """Write the dashboards, or with --check report the ones that differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    args = parser.parse_args(argv)
    stale = []
    for name, text in rendered().items():
        path = args.out / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("out of date (run python deploy/grafana/generate.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
