"""The autoscaler's recording rules: promtool accepts them and they compute the right SLIs."""

from pathlib import Path

import yaml
from promtool import RULES_FILE, promtool

RECORD_TTFT = "namespace_modelserver_model_name:minisgl_time_to_first_token_seconds:p95_1m"
RECORD_TPOT = "namespace_modelserver_model_name:minisgl_time_per_output_token_seconds:p95_1m"
RECORD_WAITING = "namespace_modelserver_model_name:minisgl_num_requests_waiting:avg_per_replica"


def test_rules_file_is_a_plain_prometheus_rules_file() -> None:
    doc = yaml.safe_load(RULES_FILE.read_text())
    records = {r["record"] for g in doc["groups"] for r in g["rules"]}
    assert {RECORD_TTFT, RECORD_TPOT, RECORD_WAITING} <= records
    result = promtool("check", "rules", RULES_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def _buckets(metric: str, pod: str, model: str, per_step: dict[str, int]) -> list[dict[str, str]]:
    return [
        {
            "series": f'{metric}_bucket{{namespace="ns",model_name="{model}",pod="{pod}",le="{le}"}}',
            "values": f"0+{inc}x10",
        }
        for le, inc in per_step.items()
    ]


def test_rules_compute_slis_on_synthetic_series(tmp_path: Path) -> None:
    ttft = "minisgl_time_to_first_token_seconds"
    tpot = "minisgl_time_per_output_token_seconds"
    # Two replicas of model "m" with different latency shapes; per 15 s step, summed over both
    # pods: le=0.1 -> 10, le=0.5 -> 16, le=1 -> 20 of 20. Rank 0.95 * 20 = 19 lies 3/4 into
    # (0.5, 1], so p95 = 0.875. The single replica of "other" has all requests under 0.1 s, so
    # its p95 interpolates to 0.095.
    series = (
        _buckets(ttft, "a", "m", {"0.1": 9, "0.5": 10, "1": 10, "+Inf": 10})
        + _buckets(ttft, "b", "m", {"0.1": 1, "0.5": 6, "1": 10, "+Inf": 10})
        + _buckets(ttft, "c", "other", {"0.1": 4, "0.5": 4, "1": 4, "+Inf": 4})
        # TPOT of "m": half the tokens in (0.01, 0.05], half in (0.05, 0.1]: p95 = 0.095.
        + _buckets(tpot, "a", "m", {"0.01": 0, "0.05": 5, "0.1": 10, "+Inf": 10})
        + [
            {"series": 'minisgl_requests_total{namespace="ns",model_name="m",pod="a",finish_reason="stop"}',
             "values": "0+6x10"},
            {"series": 'minisgl_requests_total{namespace="ns",model_name="m",pod="b",finish_reason="length"}',
             "values": "0+4x10"},
            {"series": 'minisgl_requests_total{namespace="ns",model_name="other",pod="c",finish_reason="stop"}',
             "values": "0+4x10"},
            {"series": 'minisgl_generation_tokens_total{namespace="ns",model_name="m",pod="a"}',
             "values": "0+100x10"},
            {"series": 'minisgl_num_requests_waiting{namespace="ns",model_name="m",pod="a"}',
             "values": "3x10"},
            {"series": 'minisgl_num_requests_waiting{namespace="ns",model_name="m",pod="b"}',
             "values": "5x10"},
            {"series": 'minisgl_num_requests_waiting{namespace="ns",model_name="other",pod="c"}',
             "values": "7x10"},
        ]
    )  # fmt: skip

    def exp(value: float, model: str) -> dict[str, object]:
        return {"labels": f'{{namespace="ns",model_name="{model}"}}', "value": value}

    # Functions drop the recorded name, and *1000 + round compares without float noise.
    def check(expr: str, *samples: tuple[float, str]) -> dict[str, object]:
        return {
            "expr": f"round(({expr}) * 1000)",
            "eval_time": "2m",
            "exp_samples": [exp(v, model) for v, model in samples],
        }

    test = {
        "rule_files": [str(RULES_FILE)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "promql_expr_test": [
                    check(RECORD_TTFT, (875, "m"), (95, "other")),
                    check(RECORD_TPOT, (95, "m")),
                    check(RECORD_WAITING, (4000, "m"), (7000, "other")),
                    # 6 + 4 requests per 15 s step for "m", 4 for "other"; 100 tokens per step.
                    check("namespace_modelserver_model_name:minisgl_requests:rate1m", (667, "m"), (267, "other")),
                    check("namespace_modelserver_model_name:minisgl_generation_tokens:rate1m", (6667, "m")),
                ],
            }
        ],
    }  # fmt: skip
    path = tmp_path / "rules_test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = promtool("test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_keep_two_modelservers_of_one_model_name_apart(tmp_path: Path) -> None:
    # Two ModelServers in one namespace serve the model name "m"; their pods' series carry
    # minisgl_io_modelserver (the chart's monitors copy the pods' minisgl.io/modelserver label).
    # "fast" answers every request within 0.1 s, "slow" within 1 s: one p95 each, not a blend.
    def series(ms: str, pod: str, per_step: dict[str, int], waiting: int) -> list[dict[str, str]]:
        labels = f'namespace="ns",minisgl_io_modelserver="{ms}",model_name="m",pod="{pod}"'
        out = [
            {
                "series": f'minisgl_time_to_first_token_seconds_bucket{{{labels},le="{le}"}}',
                "values": f"0+{inc}x10",
            }
            for le, inc in per_step.items()
        ]
        out.append(
            {"series": f"minisgl_num_requests_waiting{{{labels}}}", "values": f"{waiting}x10"}
        )
        return out

    inputs = series("fast", "a", {"0.1": 10, "1": 10, "+Inf": 10}, 3) + series(
        "slow", "b", {"0.1": 0, "1": 10, "+Inf": 10}, 5
    )

    def check(expr: str, fast: float, slow: float) -> dict[str, object]:
        return {
            "expr": f"round(({expr}) * 1000)",
            "eval_time": "2m",
            "exp_samples": [
                {
                    "labels": f'{{namespace="ns",minisgl_io_modelserver="{ms}",model_name="m"}}',
                    "value": v,
                }
                for ms, v in (("fast", fast), ("slow", slow))
            ],
        }

    test = {
        "rule_files": [str(RULES_FILE)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": inputs,
                "promql_expr_test": [
                    check(RECORD_TTFT, 95, 955),
                    check(RECORD_WAITING, 3000, 5000),
                ],
            }
        ],
    }
    path = tmp_path / "rules_test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = promtool("test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
