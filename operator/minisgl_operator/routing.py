"""Routing through the Gateway API Inference Extension: an InferencePool over the serving pods,
its endpoint picker (EPP: Deployment, Service, ServiceAccount, Role, RoleBinding) and an
optional HTTPRoute from a Gateway to the pool.

The picker is the upstream one (gateway-api-inference-extension's `epp`); it scrapes each
pod's /metrics and scores pods by queue length and KV-cache use, so it is told our metric
names (it defaults to vLLM's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from minisgl_operator import queries
from minisgl_operator.meta import child_metadata, epp_name
from minisgl_operator.spec import ModelServerSpec
from minisgl_operator.workload import serving_selector

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_X_GROUP = "inference.networking.x-k8s.io"  # the picker's alpha objectives
GATEWAY_API_VERSION = "gateway.networking.k8s.io/v1"
DEFAULT_EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.3.0"  # epp_flags.yaml
EPP_GRPC_PORT = 9002  # ext-proc, what the gateway calls
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_HEALTH_SERVICE = "inference-extension"
# An HTTPRoute's default request timeout is the gateway's (often 15 s): too short for a long
# generation, so the route allows what a streamed completion may take.
ROUTE_REQUEST_TIMEOUT = "600s"

# Our gauges, by the picker's flag that names them. Metrics the picker reads that minisgl does
# not have (vLLM's LoRA and cache-config info) are turned off with an empty name.
EPP_METRIC_FLAGS: tuple[tuple[str, str], ...] = (
    ("--total-queued-requests-metric", queries.WAITING_GAUGE),
    ("--total-running-requests-metric", queries.RUNNING_GAUGE),
    ("--kv-cache-usage-percentage-metric", queries.KV_USAGE_GAUGE),
    ("--lora-info-metric", ""),
    ("--cache-info-metric", ""),
)


@dataclass(frozen=True)
class PickerConfig:
    """The endpoint picker's image and extra flags (the operator's --epp-image/--epp-arg)."""

    image: str = DEFAULT_EPP_IMAGE
    extra_args: tuple[str, ...] = ()


def inference_pool(owner: Mapping[str, Any], spec: ModelServerSpec, port: int) -> dict[str, Any]:
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": child_metadata(owner),
        "spec": {
            "selector": {"matchLabels": serving_selector(spec)},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp_name(spec.name),
                "port": {"number": EPP_GRPC_PORT},
                # No picker, no routing: requests fail rather than bypass the picker.
                "failureMode": "FailClose",
            },
        },
    }


def _epp_labels(spec: ModelServerSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "minisgl-epp", "app.kubernetes.io/instance": spec.name}


def _epp_metadata(owner: Mapping[str, Any], spec: ModelServerSpec) -> dict[str, Any]:
    meta = child_metadata(owner, epp_name(spec.name))
    meta["labels"] = {**meta["labels"], "app.kubernetes.io/component": "endpoint-picker"}
    return meta


def epp_args(spec: ModelServerSpec, extra: Sequence[str]) -> list[str]:
    args = ["--pool-name", spec.name, "--pool-namespace", spec.namespace]
    for flag, metric in EPP_METRIC_FLAGS:
        args += [flag, metric]
    # Its metrics endpoint would otherwise need cluster-wide TokenReview rights.
    args.append("--metrics-endpoint-auth=false")
    return args + list(extra)


def _grpc_probe(period: int) -> dict[str, Any]:
    return {
        "grpc": {"port": EPP_HEALTH_PORT, "service": EPP_HEALTH_SERVICE},
        "initialDelaySeconds": 5,
        "periodSeconds": period,
    }


def epp_deployment(
    owner: Mapping[str, Any], spec: ModelServerSpec, picker: PickerConfig
) -> dict[str, Any]:
    container = {
        "name": "epp",
        "image": picker.image,
        "args": epp_args(spec, picker.extra_args),
        "ports": [
            {"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
        ],
        "livenessProbe": _grpc_probe(10),
        "readinessProbe": _grpc_probe(5),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _epp_metadata(owner, spec),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": _epp_labels(spec)},
            "template": {
                "metadata": {"labels": _epp_labels(spec)},
                "spec": {
                    "serviceAccountName": epp_name(spec.name),
                    "containers": [container],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                },
            },
        },
    }


def epp_service(owner: Mapping[str, Any], spec: ModelServerSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _epp_metadata(owner, spec),
        "spec": {
            "type": "ClusterIP",
            "selector": _epp_labels(spec),
            "ports": [
                {
                    "name": "grpc-ext-proc",
                    "port": EPP_GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                    "appProtocol": "http2",
                },
                {"name": "http-metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def epp_service_account(owner: Mapping[str, Any], spec: ModelServerSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _epp_metadata(owner, spec)}


def epp_role(owner: Mapping[str, Any], spec: ModelServerSpec) -> dict[str, Any]:
    """What the picker reads in its namespace: the pods it scores and its pool (plus the
    alpha objectives it watches when their CRDs exist)."""
    read = ["get", "list", "watch"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _epp_metadata(owner, spec),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": read},
            {"apiGroups": [INFERENCE_GROUP], "resources": ["inferencepools"], "verbs": read},
            {
                "apiGroups": [INFERENCE_X_GROUP],
                "resources": ["inferenceobjectives", "inferencemodelrewrites"],
                "verbs": read,
            },
        ],
    }


def epp_role_binding(owner: Mapping[str, Any], spec: ModelServerSpec) -> dict[str, Any]:
    name = epp_name(spec.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _epp_metadata(owner, spec),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
    }


def http_route(owner: Mapping[str, Any], spec: ModelServerSpec) -> dict[str, Any]:
    gw = spec.routing.gateway
    assert gw is not None
    return {
        "apiVersion": GATEWAY_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": child_metadata(owner),
        "spec": {
            "parentRefs": [
                {
                    "group": "gateway.networking.k8s.io",
                    "kind": "Gateway",
                    "name": gw.name,
                    "namespace": gw.namespace,
                }
            ],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [
                        {"group": INFERENCE_GROUP, "kind": "InferencePool", "name": spec.name}
                    ],
                    "timeouts": {"request": ROUTE_REQUEST_TIMEOUT},
                }
            ],
        },
    }


def picker_children(
    owner: Mapping[str, Any], spec: ModelServerSpec, picker: PickerConfig
) -> list[dict[str, Any]]:
    """The picker, its identity before the Deployment that runs as it."""
    return [
        epp_service_account(owner, spec),
        epp_role(owner, spec),
        epp_role_binding(owner, spec),
        epp_service(owner, spec),
        epp_deployment(owner, spec, picker),
    ]
