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


def selector_labels(name: str) -> dict[str, str]:
    """Immutable once a Deployment exists: never add to this."""
    return {"app.kubernetes.io/name": APP_NAME, MODELSERVER_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


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


def service_host(name: str, namespace: str) -> str:
    return f"{name}.{namespace}.svc"
