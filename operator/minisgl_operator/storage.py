"""The PersistentVolumeClaim that caches model weights across pod restarts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minisgl_operator.meta import cache_claim_name, child_metadata
from minisgl_operator.spec import ModelServerSpec


def access_modes(spec: ModelServerSpec, current: Mapping[str, Any] | None) -> list[str]:
    # A claim's access modes are immutable: keep whatever it was created with. A new claim is
    # ReadWriteMany when several pods may share one download, else ReadWriteOnce (which every
    # storage class offers). Every pod of a multi-node group mounts the claim, and a group's
    # pods run on different nodes: ReadWriteOnce would hold all but the first one's at attach.
    if current is not None:
        modes = (current.get("spec") or {}).get("accessModes")
        if modes:
            return list(modes)
    many = spec.replicas > 1 or spec.autoscaling is not None or spec.engine.multi_node
    return ["ReadWriteMany"] if many else ["ReadWriteOnce"]


def cache_claim(
    owner: Mapping[str, Any], spec: ModelServerSpec, current: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """None when there is no cache or the user brings their own claim."""
    cache = spec.model_cache
    if cache is None or cache.existing_claim:
        return None
    body: dict[str, Any] = {
        "accessModes": access_modes(spec, current),
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        body["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": child_metadata(owner, cache_claim_name(spec.name)),
        "spec": body,
    }
