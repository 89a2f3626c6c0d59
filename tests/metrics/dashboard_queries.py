"""The PromQL of the Grafana dashboards, with Grafana's variables replaced for plain Prometheus."""

import json
import re
from typing import Any

from promtool import DASHBOARD_DIR

# What Grafana substitutes: "All" for the label variables, and a window for $__rate_interval
# that holds several samples at the test's 1 s scrape interval.
VARIABLES = {
    "$namespace": ".*",
    "$modelserver": ".*",
    "$model_name": ".*",
    "$pod": ".*",
    "$__rate_interval": "1m",
}
# Metric names, not the label minisgl_io_modelserver (the pods' minisgl.io/modelserver label).
METRIC_NAME = re.compile(r"\bminisgl_(?!io_modelserver\b)[a-z0-9_]+\b")


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """All panels, including those nested in collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def substitute(expr: str, **picked: str) -> str:
    """Grafana's variables replaced: "All" unless `picked` names a value (e.g. modelserver=)."""
    for var, value in VARIABLES.items():
        expr = expr.replace(var, picked.get(var[1:], value))
    return expr


def queries() -> list[tuple[str, str]]:
    """(dashboard/panel/refId, runnable PromQL) of every target of every dashboard."""
    return [
        (f"{name}/{panel['title']}/{target['refId']}", substitute(target["expr"]))
        for name, dash in dashboards().items()
        for panel in panels(dash)
        for target in panel.get("targets", [])
    ]
