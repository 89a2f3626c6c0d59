"""ModelServer -> the full set of children it should have (and those it should not)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minisgl_operator import autoscaling, network, storage, workload
from minisgl_operator.launch import Launch, launch
from minisgl_operator.meta import cache_claim_name
from minisgl_operator.spec import ModelServerSpec, parse_spec


@dataclass(frozen=True)
class ChildKind:
    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]


DEPLOYMENT = ChildKind("apps/v1", "Deployment", "deployments")
SERVICE = ChildKind("v1", "Service", "services")
CLAIM = ChildKind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
INGRESS = ChildKind("networking.k8s.io/v1", "Ingress", "ingresses")
SCALED_OBJECT = ChildKind(autoscaling.KEDA_API_VERSION, "ScaledObject", "scaledobjects")
HPA = ChildKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers")
KINDS = {k.kind: k for k in (DEPLOYMENT, SERVICE, CLAIM, INGRESS, SCALED_OBJECT, HPA)}


@dataclass(frozen=True)
class Cluster:
    """What the operator knows about the cluster and its own configuration."""

    keda: bool = False
    prometheus_url: str | None = None


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


@dataclass
class Plan:
    spec: ModelServerSpec
    launch: Launch
    apply: list[dict[str, Any]]
    delete: list[tuple[ChildKind, str]]
    replicas: int
    scale_down_held: bool = False
    problems: list[Problem] = field(default_factory=list)


def _autoscaler(
    owner: Mapping[str, Any], spec: ModelServerSpec, cluster: Cluster, problems: list[Problem]
) -> dict[str, Any] | None:
    auto = spec.autoscaling
    if auto is None:
        return None
    if not cluster.keda:
        return autoscaling.hpa(owner, spec)
    url = auto.prometheus_url or cluster.prometheus_url
    if url is None:
        problems.append(
            Problem(
                "AutoscalingUnavailable",
                "KEDA needs a Prometheus to query: set spec.autoscaling.prometheusUrl or run "
                "the operator with --prometheus-url",
            )
        )
        return None
    return autoscaling.scaled_object(owner, spec, url)


def plan(
    owner: Mapping[str, Any],
    cluster: Cluster,
    current_deployment: Mapping[str, Any] | None = None,
    current_claim: Mapping[str, Any] | None = None,
) -> Plan:
    """Desired children of a ModelServer object; raises SpecError if it cannot be served."""
    meta = owner["metadata"]
    spec = parse_spec(meta["name"], meta["namespace"], owner.get("spec"))
    run = launch(spec)
    replicas, held = workload.desired_replicas(spec, current_deployment)
    problems: list[Problem] = []
    wanted: list[dict[str, Any] | None] = [
        workload.deployment(owner, spec, run, replicas),
        network.service(owner, spec, run.port),
        storage.cache_claim(owner, spec, current_claim),
        network.ingress(owner, spec) if spec.ingress else None,
        _autoscaler(owner, spec, cluster, problems),
    ]
    apply = [c for c in wanted if c is not None]
    present = {(c["kind"], c["metadata"]["name"]) for c in apply}
    delete = []
    for kind in KINDS.values():
        name = cache_claim_name(spec.name) if kind is CLAIM else spec.name
        if kind is SCALED_OBJECT and not cluster.keda:
            continue  # the API does not exist: nothing to delete, and asking would fail
        if (kind.kind, name) not in present:
            delete.append((kind, name))
    return Plan(spec, run, apply, delete, replicas, held, problems)
