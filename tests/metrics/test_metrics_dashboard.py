"""Grafana dashboards: importable JSON whose every query uses series ServerMetrics exposes."""

from pathlib import Path

import yaml
from dashboard_queries import METRIC_NAME, dashboards, panels, queries, substitute
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


# The label selectors every query carries: the pickers at the dashboard's top.
PICKERS = (
    'namespace=~"$namespace"',
    'minisgl_io_modelserver=~"$modelserver"',
    'model_name=~"$model_name"',
    'pod=~"$pod"',
)


def exposed_sample_names() -> set[str]:
    m = ServerMetrics("any")
    return {s.name for _, samples in parse(m.render()[0]).values() for s in samples}


def test_overview_dashboard_has_the_operator_panels_and_variables() -> None:
    dash = dashboards()["minisgl-overview.json"]
    assert dash["uid"] and dash["title"]
    titles = {p["title"] for p in panels(dash)}
    assert titles >= REQUIRED_PANELS, REQUIRED_PANELS - titles
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "modelserver", "model_name", "pod"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "modelserver", "model_name", "pod"):
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
                # Each panel follows the namespace, ModelServer, model and pod pickers.
                for picker in PICKERS:
                    assert picker in expr, (picker, expr)


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


def test_modelserver_picker_shows_one_modelserver_of_a_shared_model_name(tmp_path: Path) -> None:
    # Two ModelServers in one namespace serve the model name "m" (their pods' series carry
    # minisgl_io_modelserver, as the chart's monitors label them): "fast" answers within 0.1 s,
    # "slow" within 1 s. Picking "fast" must show fast's p95 (0.095 s), not the blend of both.
    dash = dashboards()["minisgl-overview.json"]
    (panel,) = [p for p in panels(dash) if p["title"] == "Time to first token"]
    (p95,) = [t["expr"] for t in panel["targets"] if "histogram_quantile(0.95," in t["expr"]]
    series = [
        {
            "series": 'minisgl_time_to_first_token_seconds_bucket{namespace="ns",'
            f'minisgl_io_modelserver="{ms}",model_name="m",pod="{pod}",le="{le}"}}',
            "values": f"0+{inc}x10",
        }
        for ms, pod, per_step in (
            ("fast", "a", {"0.1": 10, "1": 10, "+Inf": 10}),
            ("slow", "b", {"0.1": 0, "1": 10, "+Inf": 10}),
        )
        for le, inc in per_step.items()
    ]
    rules = tmp_path / "none.yaml"
    rules.write_text("groups: []\n")
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": f"round(({substitute(p95, modelserver=ms)}) * 1000)",
                        "eval_time": "2m",
                        "exp_samples": [{"labels": "{}", "value": v}],
                    }
                    for ms, v in (("fast", 95), ("slow", 955))
                ],
            }
        ],
    }
    path = tmp_path / "dashboard_test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = promtool("test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
