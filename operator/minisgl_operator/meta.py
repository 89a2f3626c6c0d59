"""Names, labels and owner references shared by every child of a ModelServer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minisgl_operator import (
    API_VERSION,
    FIELD_MANAGER,
    KIND,
    MANAGED_BY_LABEL,
    MODELSERVER_LABEL,
)

APP_NAME = "minisgl-server"
CACHE_SUFFIX = "-cache"
EPP_SUFFIX = "-epp"


def selector_labels(name: str) -> dict[str, str]:
    """Immutable once a Deployment exists: never add to this."""
    return {"app.kubernetes.io/name": APP_NAME, MODELSERVER_LABEL: name}


# LeaderWorkerSet labels each pod with its index in the group; the leader (index 0) is the one
# that serves the API.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def pod_selector_labels(name: str, leaders_only: bool = False) -> dict[str, str]:
    """The serving pods: every pod, or only the group leaders of a multi-node ModelServer."""
    out = selector_labels(name)
    if leaders_only:
        out[LWS_WORKER_INDEX_LABEL] = "0"
    return out


def selector_string(name: str, leaders_only: bool = False) -> str:
    pods = pod_selector_labels(name, leaders_only)
    return ",".join(f"{k}={v}" for k, v in sorted(pods.items()))


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "model-server",
        MANAGED_BY_LABEL: FIELD_MANAGER,
    }


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    # controller=True makes the garbage collector delete children with their ModelServer.
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(owner: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "name": name or meta["name"],
        "namespace": meta["namespace"],
        "labels": labels(meta["name"]),
        "ownerReferences": [owner_reference(owner)],
    }


def cache_claim_name(name: str) -> str:
    return name + CACHE_SUFFIX


def epp_name(name: str) -> str:
    """The endpoint picker's Deployment, Service, ServiceAccount, Role and RoleBinding."""
    return name + EPP_SUFFIX


def service_host(name: str, namespace: str) -> str:
    return f"{name}.{namespace}.svc"
