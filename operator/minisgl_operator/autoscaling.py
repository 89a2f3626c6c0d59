"""Autoscaler for a ModelServer: a KEDA ScaledObject when KEDA is installed, else an
autoscaling/v2 HPA on prometheus-adapter pod metrics. Both target the ModelServer's /scale
subresource, so the autoscaler writes spec.replicas and the operator stays the Deployment's
only writer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minisgl_operator import API_VERSION, KIND, queries
from minisgl_operator.meta import child_metadata
from minisgl_operator.spec import AutoscalingSpec, ModelServerSpec

KEDA_API_VERSION = "keda.sh/v1alpha1"
KEDA_POLLING_S = 15
# Scale up fast when the SLO is missed (a pod takes minutes to load anyway), down one pod at a
# time.
SCALE_UP_POLICIES = [
    {"type": "Percent", "value": 100, "periodSeconds": 60},
    {"type": "Pods", "value": 2, "periodSeconds": 60},
]
SCALE_DOWN_POLICIES = [{"type": "Pods", "value": 1, "periodSeconds": 120}]


def behavior(auto: AutoscalingSpec) -> dict[str, Any]:
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": auto.scale_up_stabilization_s,
            "selectPolicy": "Max",
            "policies": SCALE_UP_POLICIES,
        },
        "scaleDown": {
            "stabilizationWindowSeconds": auto.scale_down_stabilization_s,
            "selectPolicy": "Min",
            "policies": SCALE_DOWN_POLICIES,
        },
    }


def _target_ref(spec: ModelServerSpec) -> dict[str, str]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": spec.name}


def _number(value: float) -> str:
    return f"{value:g}"


def quantity(value: float) -> str:
    """A float as a Kubernetes quantity; milli-units keep sub-second targets exact."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def keda_triggers(spec: ModelServerSpec, prometheus_url: str) -> list[dict[str, Any]]:
    auto = spec.autoscaling
    assert auto is not None
    ns, name = spec.namespace, spec.name
    t = auto.targets
    out: list[dict[str, Any]] = []

    def trigger(name: str, query: str, threshold: float, metric_type: str) -> None:
        meta = {"serverAddress": prometheus_url, "query": query, "threshold": _number(threshold)}
        out.append(
            {"type": "prometheus", "name": name, "metricType": metric_type, "metadata": meta}
        )

    # Latencies are fleet-wide values: desired = current * observed / target ("Value").
    if t.ttft_p95_s is not None:
        trigger("ttft-p95", queries.or_zero(queries.ttft_p95(ns, name)), t.ttft_p95_s, "Value")
    if t.tpot_p95_s is not None:
        trigger("tpot-p95", queries.or_zero(queries.tpot_p95(ns, name)), t.tpot_p95_s, "Value")
    # Waiting requests are a total to spread: desired = total / per-replica target.
    if t.waiting_per_replica is not None:
        q = queries.or_zero(queries.waiting_total(ns, name))
        trigger("waiting-requests", q, t.waiting_per_replica, "AverageValue")
    return out


def scaled_object(
    owner: Mapping[str, Any], spec: ModelServerSpec, prometheus_url: str
) -> dict[str, Any]:
    auto = spec.autoscaling
    assert auto is not None
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": child_metadata(owner),
        "spec": {
            "scaleTargetRef": _target_ref(spec),
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "pollingInterval": KEDA_POLLING_S,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(auto)}},
            "triggers": keda_triggers(spec, prometheus_url),
        },
    }


def _pods_metric(name: str, target: float) -> dict[str, Any]:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": quantity(target)},
        },
    }


def hpa(owner: Mapping[str, Any], spec: ModelServerSpec) -> dict[str, Any]:
    auto = spec.autoscaling
    assert auto is not None
    t = auto.targets
    metrics = []
    # Per-pod p95 averaged over pods against the target approximates the fleet p95 well
    # enough to steer by; pods still loading report nothing and the HPA leaves them out.
    if t.ttft_p95_s is not None:
        metrics.append(_pods_metric(queries.ADAPTER_TTFT_P95, t.ttft_p95_s))
    if t.tpot_p95_s is not None:
        metrics.append(_pods_metric(queries.ADAPTER_TPOT_P95, t.tpot_p95_s))
    if t.waiting_per_replica is not None:
        metrics.append(_pods_metric(queries.ADAPTER_WAITING, t.waiting_per_replica))
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(owner),
        "spec": {
            "scaleTargetRef": _target_ref(spec),
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": metrics,
            "behavior": behavior(auto),
        },
    }
