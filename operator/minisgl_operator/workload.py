"""The workload that runs a ModelServer's pods: a Deployment, or with engine.nodes > 1 a
LeaderWorkerSet whose groups of pods each serve one replica of the model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minisgl_operator import node_security
from minisgl_operator.launch import DIST_INIT_PORT, PRESTOP_SLEEP_S, STARTUP_PROBE_PERIOD_S, Launch
from minisgl_operator.meta import (
    cache_claim_name,
    child_metadata,
    labels,
    pod_selector_labels,
    selector_labels,
)
from minisgl_operator.spec import ModelServerSpec

CACHE_MOUNT = "/cache"
HF_HOME = f"{CACHE_MOUNT}/huggingface"
HF_TOKEN_KEY = "token"
RUN_AS_USER = 1000  # the server image's user
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# How long a rollout may sit without progress before the Deployment reports it failed: a
# startup may legitimately take startupTimeoutSeconds, so the deadline sits past it.
PROGRESS_DEADLINE_SLACK_S = 600
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


def scrape_annotations(port: int) -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": METRICS_PATH,
    }


def desired_replicas(spec: ModelServerSpec, current: Mapping[str, Any] | None) -> tuple[int, bool]:
    """Pods to ask for, and whether a scale-down is being held back.

    With autoscaling, spec.replicas (written by the autoscaler through /scale) is clamped to
    the bounds, and a scale-down waits while pods are still starting: the ReplicaSet removes
    unready pods first, so scaling down mid-load would throw away the model loads in flight.
    """
    wanted = spec.replicas
    auto = spec.autoscaling
    if auto is None:
        return wanted, False
    wanted = min(max(wanted, auto.min_replicas), auto.max_replicas)
    if current is None:
        return wanted, False
    have = int((current.get("spec") or {}).get("replicas") or 0)
    st = current.get("status") or {}
    loading = int(st.get("replicas") or 0) - available_replicas(current) > 0
    if wanted < have and loading and not deployment_failed(current):
        return have, True
    return wanted, False


def available_replicas(workload: Mapping[str, Any]) -> int:
    """Replicas serving: a LeaderWorkerSet counts a group once all its pods are ready (it has
    no availableReplicas)."""
    st = workload.get("status") or {}
    key = "readyReplicas" if workload.get("kind") == "LeaderWorkerSet" else "availableReplicas"
    return int(st.get(key) or 0)


def failure_conditions(deployment: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The Deployment's conditions that say its rollout failed: a progress deadline exceeded,
    or pods it cannot create (ReplicaFailure: a quota, an admission policy, ...)."""
    if deployment.get("kind") == "LeaderWorkerSet":
        return []  # it restarts failing groups itself and reports no deadline
    return [
        c
        for c in (deployment.get("status") or {}).get("conditions") or []
        if (c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded")
        or (c.get("type") == "ReplicaFailure" and c.get("status") == "True")
    ]


def deployment_failed(deployment: Mapping[str, Any]) -> bool:
    return bool(failure_conditions(deployment))


def _resources(spec: ModelServerSpec) -> dict[str, Any]:
    r = spec.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if r.gpus > 0:
        limits["nvidia.com/gpu"] = r.gpus
    if r.cpu is not None:
        requests["cpu"] = r.cpu
    if r.memory is not None:
        requests["memory"] = limits["memory"] = r.memory
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _env(spec: ModelServerSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HOME", "value": "/tmp"},
    ]
    if spec.hf_token_secret:
        ref = {"name": spec.hf_token_secret, "key": HF_TOKEN_KEY}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    # A user entry with the same name replaces ours (e.g. HF_HOME on another volume).
    theirs = {u["name"] for u in spec.env}
    return [e for e in env if e["name"] not in theirs] + [dict(u) for u in spec.env]


def _volumes(spec: ModelServerSpec) -> list[dict[str, Any]]:
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.resources.shared_memory:
        shm["sizeLimit"] = spec.resources.shared_memory
    cache: dict[str, Any]
    if spec.model_cache is None:
        cache = {"emptyDir": {}}
    else:
        claim = spec.model_cache.existing_claim or cache_claim_name(spec.name)
        cache = {"persistentVolumeClaim": {"claimName": claim}}
    return [{"name": "dshm", "emptyDir": shm}, {"name": "cache", **cache}]


def _probe(port: int, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def pod_template(spec: ModelServerSpec, launch: Launch, *, serves: bool = True) -> dict[str, Any]:
    """The pod every replica runs; `serves` is False for a multi-node group's workers, which
    run their ranks and a /health but no API (so Prometheus does not scrape them)."""
    port = launch.port
    ports = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    if launch.nodes > 1:
        ports.append({"name": "dist", "containerPort": DIST_INIT_PORT, "protocol": "TCP"})
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": CACHE_MOUNT},
    ]
    if launch.nodes > 1:
        mounts.append(node_security.volume_mount())
    container = {
        "name": "server",
        "image": spec.image,
        "command": launch.command,
        "ports": ports,
        "env": _env(spec),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        # Not ready until the model is loaded; the startup probe gives loading its own,
        # long budget so liveness never kills a pod that is still downloading weights.
        "startupProbe": _probe(port, STARTUP_PROBE_PERIOD_S, launch.startup_failure_threshold),
        "readinessProbe": _probe(port, 5, 3),
        "livenessProbe": _probe(port, 15, 4),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": _volumes(spec),
        "terminationGracePeriodSeconds": launch.termination_grace_s,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "enableServiceLinks": False,
    }
    if launch.nodes > 1:
        pod_spec["volumes"].append(node_security.volume(spec.name))
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    annotations = scrape_annotations(port) if serves else {}
    return {
        "metadata": {
            "labels": labels(spec.name),
            "annotations": {**annotations, **spec.pod_annotations},
        },
        "spec": pod_spec,
    }


def deployment(
    owner: Mapping[str, Any], spec: ModelServerSpec, launch: Launch, replicas: int
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(owner),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(spec.name)},
            "progressDeadlineSeconds": spec.startup_timeout_s + PROGRESS_DEADLINE_SLACK_S,
            # Never drop below the serving capacity during a rollout: a new pod must be
            # loaded and ready before an old one goes.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": pod_template(spec, launch),
        },
    }


def leader_worker_set(
    owner: Mapping[str, Any], spec: ModelServerSpec, launch: Launch, replicas: int
) -> dict[str, Any]:
    """One group of engine.nodes pods per replica. A pod that dies takes its group down with
    it (RecreateGroupOnPodRestart): the ranks of one model cannot continue without it, and
    the engine's own peers exit when one goes. Workers start with the leader, not after it
    is ready: the leader cannot be ready before its workers join the rendezvous."""
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": child_metadata(owner),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            # A headless Service per group, named after its leader pod (<name>-<group>): the
            # default (Shared) one would be named <name>, which is our Service, and then the
            # leader address LeaderWorkerSet hands the workers would never resolve.
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            # Like the Deployment: a new group is up before an old one goes.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "leaderWorkerTemplate": {
                "size": spec.engine.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_template(spec, launch),
                "workerTemplate": pod_template(spec, launch, serves=False),
            },
        },
    }


def workload(
    owner: Mapping[str, Any], spec: ModelServerSpec, launch: Launch, replicas: int
) -> dict[str, Any]:
    make = leader_worker_set if spec.engine.multi_node else deployment
    return make(owner, spec, launch, replicas)


def serving_selector(spec: ModelServerSpec) -> dict[str, str]:
    """The pods that serve the API: all of them, or the group leaders when multi-node."""
    return pod_selector_labels(spec.name, spec.engine.multi_node)
