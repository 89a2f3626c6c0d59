"""Pure operator functions: every spec field -> what lands in the children."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from k8s_support import validate_k8s
from minisgl_operator import API_VERSION, KIND, queries
from minisgl_operator.children import HPA, INGRESS, SCALED_OBJECT, Cluster, Plan, plan
from minisgl_operator.launch import GRACE_MARGIN_S, PRESTOP_SLEEP_S
from minisgl_operator.spec import SpecError

from minisgl.config import ServerArgs, parse_server_args

UID = "0b7d-uid"
KEDA = Cluster(keda=True, prometheus_url="http://prom.monitoring:9090")


def owner(spec: dict[str, Any], name: str = "qwen", ns: str = "llm") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": ns, "uid": UID, "generation": 3},
        "spec": copy.deepcopy(spec),
    }


def make(spec: dict[str, Any], cluster: Cluster = Cluster(), **kw: Any) -> Plan:
    p = plan(owner(spec), cluster, **kw)
    for child in p.apply:
        validate_k8s(child)
    return p


def child(p: Plan, kind: str) -> dict[str, Any]:
    (c,) = [c for c in p.apply if c["kind"] == kind]
    return c


def container(p: Plan) -> dict[str, Any]:
    return child(p, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def pod(p: Plan) -> dict[str, Any]:
    return child(p, "Deployment")["spec"]["template"]["spec"]


def flags(p: Plan) -> ServerArgs:
    cmd = container(p)["command"]
    assert cmd[:3] == ["python", "-m", "minisgl"]
    return parse_server_args(cmd[3:])


def test_minimal_spec_makes_deployment_and_service_owned_by_the_modelserver() -> None:
    p = make({"model": "Qwen/Qwen3-0.6B"})
    assert sorted(c["kind"] for c in p.apply) == ["Deployment", "Service"]
    for c in p.apply:
        (ref,) = c["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": "qwen",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert c["metadata"]["namespace"] == "llm"
        assert c["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "minisgl-operator"
    # Absent optional children are listed for pruning (no KEDA API: no ScaledObject lookups).
    # Optional CRDs that are not installed (KEDA, LWS, InferencePool, Gateway) are not asked.
    assert {(k.kind, n) for k, n in p.delete} == {
        ("PersistentVolumeClaim", "qwen-cache"),
        ("Ingress", "qwen"),
        ("HorizontalPodAutoscaler", "qwen"),
        ("Deployment", "qwen-epp"),
        ("Service", "qwen-epp"),
        ("ServiceAccount", "qwen-epp"),
        ("Role", "qwen-epp"),
        ("RoleBinding", "qwen-epp"),
        ("Secret", "qwen-node-secret"),  # a multi-node group's, left from engine.nodes > 1
        ("NetworkPolicy", "qwen-nodes"),
    }


def test_command_line_renders_only_what_the_spec_sets() -> None:
    p = make({"model": "Qwen/Qwen3-0.6B"})
    args = container(p)["command"][3:]
    assert args == ["--model", "Qwen/Qwen3-0.6B", "--device", "cuda", "--host", "0.0.0.0"]
    s = flags(p)
    assert s.port == ServerArgs.port and s.dtype == ServerArgs.dtype


def test_engine_fields_become_flags() -> None:
    p = make(
        {
            "model": "/models/qwen",
            "servedModelName": "qwen-chat",
            "engine": {
                "dtype": "float16",
                "tensorParallelSize": 2,
                "numPages": 4096,
                "maxSeqLen": 8192,
                "maxRunningRequests": 64,
                "shutdownTimeoutSeconds": 90,
                "extraArgs": ["--max-prefill-tokens", "2048", "--disable-prefix-cache"],
            },
        }
    )
    s = flags(p)
    assert (s.model, s.served_model_name, s.dtype, s.tp_size) == (
        "/models/qwen",
        "qwen-chat",
        "float16",
        2,
    )
    assert (s.num_pages, s.max_seq_len_override, s.max_running_requests) == (4096, 8192, 64)
    assert s.shutdown_timeout == 90.0 and s.max_prefill_tokens == 2048 and s.disable_prefix_cache
    assert container(p)["resources"]["limits"]["nvidia.com/gpu"] == 2  # default gpus = tp


def test_drain_budget_agrees_with_shutdown_timeout() -> None:
    for timeout in (None, 5, 300):
        engine = {"shutdownTimeoutSeconds": timeout} if timeout else {}
        p = make({"model": "m", "engine": engine})
        drain = flags(p).shutdown_timeout
        assert drain == (timeout or ServerArgs.shutdown_timeout)
        assert container(p)["lifecycle"]["preStop"]["sleep"]["seconds"] == PRESTOP_SLEEP_S
        assert pod(p)["terminationGracePeriodSeconds"] == PRESTOP_SLEEP_S + drain + GRACE_MARGIN_S


@pytest.mark.parametrize(
    "extra,why",
    [
        (["--port", "9000"], "may not set --port"),
        (["--model=other"], "may not set --model"),
        (["--tp-size", "2"], "may not set --tp-size"),
        (["--tp-size=2", "--host", "127.0.0.1"], "may not set --host, --tp-size"),
        # Abbreviations are not flags (argparse would expand them past a name check).
        (["--tp", "4"], "unrecognized arguments: --tp 4"),
        (["--hos", "127.0.0.1"], "unrecognized"),
        (["--devic", "cpu"], "unrecognized"),
        (["--mod", "x"], "unrecognized"),
        (["--served", "x"], "unrecognized"),
        (["--max-prefill", "8"], "unrecognized"),
        (["--no-such-flag"], "unrecognized"),
        (["--attention-backend", "magic"], "invalid choice"),
        (["--max-prefill-tokens", "lots"], "invalid int"),
    ],
)
def test_bad_extra_args_are_spec_errors(extra: list[str], why: str) -> None:
    with pytest.raises(SpecError, match=why):
        plan(owner({"model": "m", "engine": {"extraArgs": extra}}), Cluster())


def test_probes_tolerate_long_loads_and_check_health() -> None:
    c = container(make({"model": "m", "startupTimeoutSeconds": 3600}))
    start = c["startupProbe"]
    assert start["httpGet"] == {"path": "/health", "port": "http"}
    assert start["periodSeconds"] * start["failureThreshold"] >= 3600
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    dep = child(make({"model": "m", "startupTimeoutSeconds": 3600}), "Deployment")
    assert dep["spec"]["progressDeadlineSeconds"] > 3600


def test_pod_is_non_root_with_shm_and_rolls_without_losing_capacity() -> None:
    p = make({"model": "m", "resources": {"sharedMemory": "2Gi"}})
    sc = container(p)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert pod(p)["securityContext"]["runAsNonRoot"] is True
    assert pod(p)["securityContext"]["runAsUser"] != 0
    vols = {v["name"]: v for v in pod(p)["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    mounts = {m["mountPath"] for m in container(p)["volumeMounts"]}
    assert "/dev/shm" in mounts
    strategy = child(p, "Deployment")["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0


def test_resources() -> None:
    c = container(make({"model": "m", "resources": {"gpus": 4, "cpu": 8, "memory": "64Gi"}}))
    assert c["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"nvidia.com/gpu": 4, "memory": "64Gi"},
    }
    cpu = make({"model": "m", "resources": {"gpus": 0}})
    assert "nvidia.com/gpu" not in container(cpu)["resources"].get("limits", {})
    assert flags(cpu).device == "cpu"


def test_model_cache_claim_and_hf_home() -> None:
    p = make({"model": "m", "modelCache": {"size": "50Gi", "storageClassName": "fast"}})
    pvc = child(p, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == "qwen-cache"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert pvc["spec"]["storageClassName"] == "fast"
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    vols = {v["name"]: v for v in pod(p)["volumes"]}
    assert vols["cache"]["persistentVolumeClaim"]["claimName"] == "qwen-cache"
    env = {e["name"]: e.get("value") for e in container(p)["env"]}
    mount = {m["name"]: m["mountPath"] for m in container(p)["volumeMounts"]}["cache"]
    assert env["HF_HOME"].startswith(mount)
    # Several replicas share one download; an existing claim keeps its modes.
    shared = make({"model": "m", "replicas": 3, "modelCache": {}})
    assert child(shared, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    kept = make(
        {"model": "m", "replicas": 3, "modelCache": {}},
        current_claim={"spec": {"accessModes": ["ReadWriteOnce"]}},
    )
    assert child(kept, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_a_multi_node_groups_cache_claim_is_read_write_many() -> None:
    """One replica of engine.nodes pods: each pod (on its own node) mounts the claim, which
    ReadWriteOnce would let only one node attach (the others stuck ContainerCreating)."""
    group = {"model": "m", "engine": {"tensorParallelSize": 4, "nodes": 2}, "modelCache": {}}
    p = make(group, Cluster(leader_worker_set=True))
    assert child(p, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]


def test_existing_claim_is_mounted_not_created() -> None:
    p = make({"model": "m", "modelCache": {"existingClaim": "weights"}})
    assert not [c for c in p.apply if c["kind"] == "PersistentVolumeClaim"]
    vols = {v["name"]: v for v in pod(p)["volumes"]}
    assert vols["cache"]["persistentVolumeClaim"]["claimName"] == "weights"
    no_cache = make({"model": "m"})
    assert {v["name"]: v for v in pod(no_cache)["volumes"]}["cache"] == {
        "name": "cache",
        "emptyDir": {},
    }


def test_hf_token_env_and_user_env() -> None:
    p = make(
        {
            "model": "m",
            "hfTokenSecret": "hf",
            "env": [
                {"name": "HF_HOME", "value": "/elsewhere"},
                {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ],
        }
    )
    env = container(p)["env"]
    names = [e["name"] for e in env]
    assert names.count("HF_HOME") == 1
    by = {e["name"]: e for e in env}
    assert by["HF_HOME"]["value"] == "/elsewhere"
    assert by["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert by["X"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_scheduling_and_annotations() -> None:
    tol = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    p = make(
        {
            "model": "m",
            "image": "registry.local/minisgl:dev",
            "replicas": 2,
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [tol],
            "podAnnotations": {"team": "a"},
        }
    )
    assert container(p)["image"] == "registry.local/minisgl:dev"
    assert child(p, "Deployment")["spec"]["replicas"] == 2
    assert pod(p)["nodeSelector"] == {"gpu": "h100"}
    assert pod(p)["tolerations"] == [tol]
    ann = child(p, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert ann["team"] == "a" and ann["prometheus.io/scrape"] == "true"


def test_service_has_http_port_and_scrape_annotations() -> None:
    svc = child(make({"model": "m"}), "Service")
    (port,) = svc["spec"]["ports"]
    assert port["name"] == "http" and port["targetPort"] == "http"
    assert svc["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert svc["metadata"]["annotations"]["prometheus.io/port"] == str(ServerArgs.port)
    dep = child(make({"model": "m"}), "Deployment")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_ingress() -> None:
    p = make(
        {
            "model": "m",
            "ingress": {
                "host": "q.example.com",
                "className": "nginx",
                "tls": True,
                "annotations": {"a": "b"},
            },
        }
    )
    ing = child(p, "Ingress")
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["rules"][0]["host"] == "q.example.com"
    assert ing["spec"]["tls"] == [{"hosts": ["q.example.com"], "secretName": "qwen-tls"}]
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "qwen", "port": {"name": "http"}}
    assert ing["metadata"]["annotations"] == {"a": "b"}
    assert (INGRESS, "qwen") not in p.delete


AUTO: dict[str, Any] = {
    "model": "Qwen/Qwen3-8B",
    "servedModelName": "q8",
    "autoscaling": {
        "minReplicas": 2,
        "maxReplicas": 6,
        "targets": {"ttftP95Seconds": 0.5, "tpotP95Seconds": 0.04, "waitingRequestsPerReplica": 4},
        "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 900,
    },
}


def test_keda_scaled_object_targets_the_modelserver_with_one_trigger_per_target() -> None:
    p = make(AUTO, KEDA)
    so = child(p, "ScaledObject")
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": API_VERSION, "kind": KIND, "name": "qwen"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (2, 6)
    triggers = {t["name"]: t for t in so["spec"]["triggers"]}
    assert set(triggers) == {"ttft-p95", "tpot-p95", "waiting-requests"}
    for t in triggers.values():
        assert t["type"] == "prometheus"
        assert t["metadata"]["serverAddress"] == KEDA.prometheus_url
        assert (
            'minisgl_io_modelserver="qwen"' in t["metadata"]["query"]
            and 'namespace="llm"' in t["metadata"]["query"]
        )
    assert triggers["ttft-p95"]["metadata"]["threshold"] == "0.5"
    assert queries.TTFT_HISTOGRAM in triggers["ttft-p95"]["metadata"]["query"]
    assert queries.TPOT_HISTOGRAM in triggers["tpot-p95"]["metadata"]["query"]
    assert triggers["waiting-requests"]["metricType"] == "AverageValue"
    assert triggers["ttft-p95"]["metricType"] == "Value"
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 900
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 30
    assert (HPA, "qwen") in p.delete  # switching to KEDA removes an earlier HPA


def test_spec_prometheus_url_overrides_the_operators() -> None:
    spec = copy.deepcopy(AUTO)
    spec["autoscaling"]["prometheusUrl"] = "http://other:9090"
    so = child(make(spec, KEDA), "ScaledObject")
    assert {t["metadata"]["serverAddress"] for t in so["spec"]["triggers"]} == {"http://other:9090"}


def test_keda_without_prometheus_is_reported_not_fatal() -> None:
    p = make(AUTO, Cluster(keda=True))
    assert [pr.reason for pr in p.problems] == ["AutoscalingUnavailable"]
    assert not [c for c in p.apply if c["kind"] == "ScaledObject"]
    assert child(p, "Deployment")


def test_hpa_fallback_uses_adapter_pod_metrics() -> None:
    p = make(AUTO, Cluster(keda=False))
    h = child(p, "HorizontalPodAutoscaler")
    assert h["spec"]["scaleTargetRef"]["kind"] == KIND
    assert (h["spec"]["minReplicas"], h["spec"]["maxReplicas"]) == (2, 6)
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in h["spec"]["metrics"]}
    assert metrics[queries.ADAPTER_TTFT_P95] == {"type": "AverageValue", "averageValue": "500m"}
    assert metrics[queries.ADAPTER_TPOT_P95]["averageValue"] == "40m"
    assert metrics[queries.ADAPTER_WAITING]["averageValue"] == "4"
    assert h["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 900
    assert not any(k is SCALED_OBJECT for k, _ in p.delete)


def test_cold_start_defaults() -> None:
    h = child(make({"model": "m", "autoscaling": {"maxReplicas": 3}}), "HorizontalPodAutoscaler")
    assert h["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 600
    assert h["spec"]["behavior"]["scaleDown"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": 120}
    ]
    (metric,) = h["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == queries.ADAPTER_WAITING


def _deployment(replicas: int, ready: int, available: int) -> dict[str, Any]:
    return {
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "readyReplicas": ready, "availableReplicas": available},
    }


def test_autoscaled_replicas_are_clamped_and_scale_down_waits_for_loading_pods() -> None:
    spec = {"model": "m", "replicas": 9, "autoscaling": {"minReplicas": 2, "maxReplicas": 4}}
    assert make(spec).replicas == 4
    spec["replicas"] = 1
    assert make(spec).replicas == 2
    spec["replicas"] = 2
    held = make(spec, current_deployment=_deployment(4, 3, 3))
    assert (held.replicas, held.scale_down_held) == (4, True)
    free = make(spec, current_deployment=_deployment(4, 4, 4))
    assert (free.replicas, free.scale_down_held) == (2, False)
    stuck = _deployment(4, 3, 3)
    stuck["status"]["conditions"] = [{"type": "Progressing", "reason": "ProgressDeadlineExceeded"}]
    assert make(spec, current_deployment=stuck).replicas == 2
    # Without autoscaling a user's scale-down is honoured at once.
    manual = make({"model": "m", "replicas": 1}, current_deployment=_deployment(4, 3, 3))
    assert (manual.replicas, manual.scale_down_held) == (1, False)


def test_spec_edit_changes_the_pod_template() -> None:
    a = child(make({"model": "m"}), "Deployment")["spec"]["template"]
    b = child(make({"model": "m", "engine": {"dtype": "bfloat16"}}), "Deployment")["spec"][
        "template"
    ]
    assert a != b


def test_invalid_name_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="DNS-1035"):
        plan(owner({"model": "m"}, name="Bad_Name"), Cluster())
