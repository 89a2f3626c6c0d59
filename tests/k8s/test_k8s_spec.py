"""parse_spec: defaults and field-by-field validation; the operator's entry point."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from minisgl_operator import __main__ as cli
from minisgl_operator import handlers, spec
from minisgl_operator.spec import SpecError, parse_spec

NAN, INF = float("nan"), float("inf")


def test_defaults() -> None:
    s = parse_spec("qwen", "llm", {"model": "Qwen/Qwen3-0.6B"})
    assert s.model_name == "Qwen/Qwen3-0.6B"
    assert (s.image, s.replicas, s.startup_timeout_s) == (
        spec.DEFAULT_IMAGE,
        spec.DEFAULT_REPLICAS,
        spec.DEFAULT_STARTUP_TIMEOUT_S,
    )
    assert s.engine.tensor_parallel_size == 1 and s.resources.gpus == 1
    assert s.model_cache is None and s.autoscaling is None and s.ingress is None
    tp = parse_spec("qwen", "llm", {"model": "m", "engine": {"tensorParallelSize": 4}})
    assert tp.resources.gpus == 4  # gpus default to the TP size
    auto = parse_spec("q", "llm", {"model": "m", "autoscaling": {"maxReplicas": 2}})
    assert auto.autoscaling is not None
    assert (
        auto.autoscaling.targets.waiting_per_replica
        == spec.DEFAULT_TARGETS["waitingRequestsPerReplica"]
    )
    assert auto.autoscaling.scale_down_stabilization_s == spec.DEFAULT_SCALE_DOWN_STABILIZATION_S
    cache = parse_spec("q", "llm", {"model": "m", "modelCache": {}})
    assert cache.model_cache == spec.CacheSpec(size=spec.DEFAULT_CACHE_SIZE)


@pytest.mark.parametrize(
    "raw,message",
    [
        (None, "spec is missing"),
        ({}, "spec.model is required"),
        ({"model": "m", "replicas": "2"}, "replicas must be an integer"),
        ({"model": "m", "replicas": True}, "replicas must be an integer"),
        ({"model": "m", "engine": []}, "engine must be an object"),
        ({"model": "m", "engine": {"dtype": "fp8"}}, "engine.dtype must be one of"),
        ({"model": "m", "engine": {"numPages": 0}}, "engine.numPages must be >= 1"),
        ({"model": "m", "engine": {"maxSeqLen": -1}}, "engine.maxSeqLen"),
        ({"model": "m", "engine": {"maxRunningRequests": 0}}, "maxRunningRequests"),
        ({"model": "m", "engine": {"shutdownTimeoutSeconds": 0}}, "shutdownTimeoutSeconds"),
        ({"model": "m", "engine": {"extraArgs": "--x"}}, "extraArgs must be a list"),
        ({"model": "m", "resources": {"gpus": 1}, "engine": {"tensorParallelSize": 2}}, "gpus"),
        ({"model": "m", "resources": {"memory": ""}}, "resources.memory"),
        ({"model": "m", "modelCache": {"existingClaim": ""}}, "existingClaim"),
        ({"model": "m", "hfTokenSecret": 3.5j}, "hfTokenSecret"),
        ({"model": "m", "autoscaling": {}}, "maxReplicas is required"),
        ({"model": "m", "autoscaling": {"maxReplicas": 0}}, "maxReplicas must be >= 1"),
        (
            {"model": "m", "autoscaling": {"maxReplicas": 2, "targets": {"tpotP95Seconds": -1}}},
            "> 0",
        ),
        (
            {"model": "m", "autoscaling": {"maxReplicas": 2, "scaleDownStabilizationSeconds": -5}},
            "scaleDown",
        ),
        ({"model": "m", "ingress": {}}, "ingress.host is required"),
        ({"model": "m", "ingress": {"host": "h", "tls": "false"}}, "ingress.tls must be true or"),
        ({"model": "m", "ingress": {"host": "h", "tls": 1}}, "ingress.tls must be true or false"),
        (
            {"model": "m", "autoscaling": {"maxReplicas": 2, "targets": {"ttftP95Seconds": NAN}}},
            "ttftP95Seconds must be a finite number > 0",
        ),
        (
            {"model": "m", "autoscaling": {"maxReplicas": 2, "targets": {"tpotP95Seconds": INF}}},
            "tpotP95Seconds must be a finite number > 0",
        ),
        ({"model": "m", "tolerations": [{"effect": "Sometimes"}]}, "unknown effect"),
        ({"model": "m", "tolerations": ["x"]}, "tolerations must be a list of objects"),
        ({"model": "m", "env": [{"value": "v"}]}, "env entry needs a name"),
        ({"model": "m", "nodeSelector": ["a"]}, "nodeSelector must be an object"),
        ({"model": "m", "startupTimeoutSeconds": 10}, "startupTimeoutSeconds must be >= 60"),
        # Past 2**31 - 601 the Deployment's progressDeadlineSeconds (it + 600) overflowed.
        (
            {"model": "m", "startupTimeoutSeconds": 2**31 - 1},
            "startupTimeoutSeconds must be <= 86400",
        ),
    ],
)
def test_field_errors(raw: Any, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec("qwen", "llm", raw)


def test_quantities_may_be_numbers() -> None:
    s = parse_spec("q", "llm", {"model": "m", "resources": {"cpu": 4, "memory": "8Gi"}})
    assert (s.resources.cpu, s.resources.memory) == ("4", "8Gi")


def test_main_runs_kopf_cluster_wide_or_in_one_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cli.kopf, "run", lambda **kw: calls.append(kw))
    monkeypatch.setattr(handlers, "CONFIG", handlers.CONFIG)
    cli.main([])
    assert calls[-1]["clusterwide"] is True and calls[-1]["standalone"] is True
    assert handlers.CONFIG.prometheus_url is None
    cli.main(["--namespace", "team-a", "--prometheus-url", "http://prom:9090"])
    assert calls[-1]["clusterwide"] is False and calls[-1]["namespaces"] == ["team-a"]
    assert handlers.CONFIG.prometheus_url == "http://prom:9090"


def test_library_request_logs_stay_quiet_unless_verbose(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cli.kopf, "run", lambda **kw: None)
    monkeypatch.setattr(handlers, "CONFIG", handlers.CONFIG)
    levels = {n: logging.getLogger(n).level for n in ("httpx", "httpcore")}
    client = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    caplog.set_level(logging.DEBUG)
    try:
        cli.main([])
        client.get("https://k8s.local/api/v1/namespaces/llm/services/q")
        assert "HTTP Request" not in caplog.text  # httpx logs each request at INFO
        logging.getLogger("minisgl_operator").info("reconciled qwen")
        assert "reconciled qwen" in caplog.text  # the operator's own events still show
        cli.main(["--verbose"])
        client.get("https://k8s.local/api/v1/namespaces/llm/services/q")
        assert "HTTP Request: GET https://k8s.local/api/v1/namespaces/llm/services/q" in caplog.text
    finally:
        client.close()
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_operator_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, minisgl_operator.handlers, minisgl_operator.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
