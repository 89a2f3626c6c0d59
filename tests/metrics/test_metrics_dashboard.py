"""Grafana dashboards: importable JSON whose every query uses series ServerMetrics exposes."""

from pathlib import Path

import yaml
from dashboard_queries import METRIC_NAME, dashboards, panels, queries
from metrics_text import parse
from promtool import promtool

from minisgl.metrics import ServerMetrics

REQUIRED_PANELS = {
    "Time to first token",
    "Time per output token",
    "Inter-token latency",
    "End-to-end request latency",
    "Request rate by finish reason",
    "Tokens/s",
    "Running and waiting requests",
    "KV cache usage",
    "Prefix cache hit rate",
    "Batch size",
    "Speculative decoding acceptance",
}


def exposed_sample_names() -> set[str]:
    m = ServerMetrics("any")
    return {s.name for _, samples in parse(m.render()[0]).values() for s in samples}


def test_overview_dashboard_has_the_operator_panels_and_variables() -> None:
    dash = dashboards()["minisgl-overview.json"]
    assert dash["uid"] and dash["title"]
    titles = {p["title"] for p in panels(dash)}
    assert titles >= REQUIRED_PANELS, REQUIRED_PANELS - titles
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "model_name", "pod"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model_name", "pod"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    for quantile in ("0.5", "0.95", "0.99"):
        for title in ("Time to first token", "Time per output token", "Inter-token latency"):
            (panel,) = [p for p in panels(dash) if p["title"] == title]
            assert any(f"histogram_quantile({quantile}," in t["expr"] for t in panel["targets"])


def test_every_panel_queries_exposed_metrics_through_the_datasource_variable() -> None:
    exposed = exposed_sample_names()
    for name, dash in dashboards().items():
        ids = [p["id"] for p in panels(dash)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in panels(dash):
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], f"{name}/{panel['title']} has no query"
            for target in panel["targets"]:
                expr = target["expr"]
                assert target["datasource"]["uid"] == "${datasource}"
                used = set(METRIC_NAME.findall(expr))
                assert used, f"{panel['title']}: no minisgl metric in {expr}"
                assert used <= exposed, f"{panel['title']}: unknown {used - exposed}"
                # Each panel follows the model and pod pickers.
                assert 'model_name=~"$model_name"' in expr and 'pod=~"$pod"' in expr, expr


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool has no query linter, but it parses the expressions of a rules file.
    rules = [
        {"record": f"dashboard:query:{i}", "expr": expr} for i, (_, expr) in enumerate(queries())
    ]
    path = tmp_path / "dashboard_queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout
