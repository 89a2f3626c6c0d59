"""ModelServer -> the full set of children it should have (and those it should not)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minisgl_operator import autoscaling, network, node_security, routing, storage, workload
from minisgl_operator.launch import Launch, launch
from minisgl_operator.meta import cache_claim_name, epp_name
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
LEADER_WORKER_SET = ChildKind(workload.LWS_API_VERSION, "LeaderWorkerSet", "leaderworkersets")
SERVICE = ChildKind("v1", "Service", "services")
CLAIM = ChildKind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
INGRESS = ChildKind("networking.k8s.io/v1", "Ingress", "ingresses")
SCALED_OBJECT = ChildKind(autoscaling.KEDA_API_VERSION, "ScaledObject", "scaledobjects")
HPA = ChildKind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers")
INFERENCE_POOL = ChildKind(routing.INFERENCE_POOL_API_VERSION, "InferencePool", "inferencepools")
HTTP_ROUTE = ChildKind(routing.GATEWAY_API_VERSION, "HTTPRoute", "httproutes")
SERVICE_ACCOUNT = ChildKind("v1", "ServiceAccount", "serviceaccounts")
ROLE = ChildKind("rbac.authorization.k8s.io/v1", "Role", "roles")
ROLE_BINDING = ChildKind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
SECRET = ChildKind("v1", "Secret", "secrets")
NETWORK_POLICY = ChildKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies")
KINDS = {
    k.kind: k
    for k in (
        DEPLOYMENT,
        LEADER_WORKER_SET,
        SERVICE,
        CLAIM,
        INGRESS,
        SCALED_OBJECT,
        HPA,
        INFERENCE_POOL,
        HTTP_ROUTE,
        SERVICE_ACCOUNT,
        ROLE,
        ROLE_BINDING,
        SECRET,
        NETWORK_POLICY,
    )
}
# Kinds the operator may not be granted (chart values rbac.leaderWorkerSet/inferencePool).
OPT_IN_KINDS = (
    LEADER_WORKER_SET,
    SECRET,
    NETWORK_POLICY,
    INFERENCE_POOL,
    HTTP_ROUTE,
    SERVICE_ACCOUNT,
    ROLE,
    ROLE_BINDING,
)


def possible_children(name: str) -> list[tuple[ChildKind, str]]:
    """Every (kind, name) a ModelServer may own: what the plan does not want is pruned."""
    epp = epp_name(name)
    return [
        (DEPLOYMENT, name),
        (LEADER_WORKER_SET, name),
        (SERVICE, name),
        (CLAIM, cache_claim_name(name)),
        (INGRESS, name),
        (SCALED_OBJECT, name),
        (HPA, name),
        (HTTP_ROUTE, name),
        (INFERENCE_POOL, name),
        (DEPLOYMENT, epp),
        (SERVICE, epp),
        (ROLE_BINDING, epp),
        (ROLE, epp),
        (SERVICE_ACCOUNT, epp),
        (SECRET, node_security.secret_name(name)),
        (NETWORK_POLICY, node_security.policy_name(name)),
    ]


@dataclass(frozen=True)
class Cluster:
    """What the operator knows about the cluster and its own configuration."""

    keda: bool = False
    prometheus_url: str | None = None
    leader_worker_set: bool = False  # the LWS CRD is installed
    inference_pool: bool = False  # the InferencePool CRD (inference.networking.k8s.io/v1)
    gateway_api: bool = False  # HTTPRoute (gateway.networking.k8s.io/v1)
    picker: routing.PickerConfig = routing.PickerConfig()

    def serves(self, kind: ChildKind) -> bool:
        return {
            SCALED_OBJECT: self.keda,
            LEADER_WORKER_SET: self.leader_worker_set,
            INFERENCE_POOL: self.inference_pool,
            HTTP_ROUTE: self.gateway_api,
        }.get(kind, True)


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


def workload_kind(spec: ModelServerSpec) -> ChildKind:
    return LEADER_WORKER_SET if spec.engine.multi_node else DEPLOYMENT


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


def _routing(
    owner: Mapping[str, Any],
    spec: ModelServerSpec,
    port: int,
    cluster: Cluster,
    problems: list[Problem],
) -> list[dict[str, Any]]:
    if not spec.routing.inference_pool:
        return []
    if not cluster.inference_pool:
        problems.append(
            Problem(
                "InferencePoolNotInstalled",
                "spec.routing.inferencePool needs the InferencePool CRD "
                f"({routing.INFERENCE_POOL_API_VERSION}): install the Gateway API Inference "
                "Extension; the Service serves meanwhile",
            )
        )
        return []
    out = [routing.inference_pool(owner, spec, port)]
    out += routing.picker_children(owner, spec, cluster.picker)
    if spec.routing.gateway is not None:
        if cluster.gateway_api:
            out.append(routing.http_route(owner, spec))
        else:
            problems.append(
                Problem(
                    "GatewayAPINotInstalled",
                    "spec.routing.gatewayRef needs the HTTPRoute CRD "
                    f"({routing.GATEWAY_API_VERSION}): install the Gateway API",
                )
            )
    return out


def plan(
    owner: Mapping[str, Any],
    cluster: Cluster,
    current_deployment: Mapping[str, Any] | None = None,
    current_claim: Mapping[str, Any] | None = None,
    current_secret: Mapping[str, Any] | None = None,
) -> Plan:
    """Desired children of a ModelServer object; raises SpecError if it cannot be served.

    `current_deployment` is the workload of the kind the spec asks for (Deployment or
    LeaderWorkerSet) as it runs now, or None; `current_secret` the node secret we made (a
    multi-node group's secret is kept, never replaced)."""
    meta = owner["metadata"]
    spec = parse_spec(meta["name"], meta["namespace"], owner.get("spec"))
    run = launch(spec)
    replicas, held = workload.desired_replicas(spec, current_deployment)
    problems: list[Problem] = []
    if spec.engine.multi_node and not cluster.leader_worker_set:
        # Change nothing: a Service or pool without its pods, or a Deployment removed for a
        # LeaderWorkerSet that cannot be made, would be worse than what runs now.
        problems.append(
            Problem(
                "LeaderWorkerSetNotInstalled",
                f"engine.nodes={spec.engine.nodes} needs the LeaderWorkerSet CRD "
                f"({workload.LWS_API_VERSION}): install kubernetes-sigs/lws",
            )
        )
        return Plan(spec, run, [], [], replicas, held, problems)
    wanted: list[dict[str, Any] | None] = [
        workload.workload(owner, spec, run, replicas),
        network.service(owner, spec, run.port),
        storage.cache_claim(owner, spec, current_claim),
        network.ingress(owner, spec) if spec.ingress else None,
        _autoscaler(owner, spec, cluster, problems),
        *_routing(owner, spec, run.port, cluster, problems),
    ]
    if spec.engine.multi_node:
        wanted.append(node_security.secret(owner, current_secret))
        wanted.append(node_security.network_policy(owner, run.port))
    apply = [c for c in wanted if c is not None]
    present = {(c["kind"], c["metadata"]["name"]) for c in apply}
    delete = [
        (kind, name)
        for kind, name in possible_children(spec.name)
        # An API that is not served has nothing to delete, and asking would fail.
        if cluster.serves(kind) and (kind.kind, name) not in present
    ]
    return Plan(spec, run, apply, delete, replicas, held, problems)
