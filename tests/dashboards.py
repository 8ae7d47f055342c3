"""Reading the committed Grafana dashboards: their panels and PromQL, macros substituted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.ops_tools import REPO_ROOT

DASHBOARD_DIR = REPO_ROOT / "deploy" / "grafana" / "dashboards"
RULES = REPO_ROOT / "deploy" / "prometheus" / "rules" / "liveloop-alerts.yml"
# What Grafana puts in place of its macros; windows long enough for a test's short run.
MACROS = {"$__rate_interval": "5m", "$__range": "10m", "$__interval": "1m"}


@dataclass(frozen=True)
class PanelQuery:
    """One target of one panel."""

    dashboard: str
    panel: str
    ref_id: str
    expr: str

    @property
    def name(self) -> str:
        """`dashboard / panel / refId`, for messages."""
        return f"{self.dashboard} / {self.panel} / {self.ref_id}"

    @property
    def promql(self) -> str:
        """The expression with Grafana's macros replaced."""
        expr = self.expr
        for macro, value in MACROS.items():
            expr = expr.replace(macro, value)
        return expr


def dashboard_files() -> list[Path]:
    """The committed dashboard files."""
    return sorted(DASHBOARD_DIR.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    """One dashboard's JSON."""
    return dict(json.loads(path.read_text()))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every non-row panel, including those nested in collapsed rows."""
    out: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def panel_queries() -> list[PanelQuery]:
    """Every panel target of every dashboard."""
    queries = []
    for path in dashboard_files():
        dashboard = load(path)
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                queries.append(
                    PanelQuery(dashboard["title"], panel["title"], target["refId"], target["expr"])
                )
    return queries
