"""What guards a multi-node ModelServer's node ports: a shared secret and a NetworkPolicy.

The pods of a group talk over the rendezvous port and the three after it (step broadcast, acks,
node link), and torch.distributed's collectives open ports of their own. minisgl admits only
peers that prove they hold the group's secret (`--node-secret-file`); the operator makes that
secret, one per ModelServer: random, made once, owned by the ModelServer (so deleted with
it) and never rotated by a reconcile: what exists is kept. Every pod mounts it read-only.

The NetworkPolicy lets the pods of the ModelServer (they share the secret) reach each other on
any port, and everyone else reach only the API port: the node ports accept nobody else.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping
from typing import Any

from minisgl.config import MIN_NODE_SECRET_CHARS
from minisgl_operator.meta import child_metadata, selector_labels

SECRET_SUFFIX = "-node-secret"
POLICY_SUFFIX = "-nodes"
SECRET_KEY = "node-secret"
VOLUME = "node-secret"
MOUNT_DIR = "/etc/minisgl/node-secret"
SECRET_FILE = f"{MOUNT_DIR}/{SECRET_KEY}"
FILE_MODE = 0o440  # the pod's group (fsGroup) reads it; nobody writes


def secret_name(name: str) -> str:
    return name + SECRET_SUFFIX


def policy_name(name: str) -> str:
    return name + POLICY_SUFFIX


def _kept(current: Mapping[str, Any] | None) -> str | None:
    """The value the Secret holds now (base64), when it is a usable one."""
    value = ((current or {}).get("data") or {}).get(SECRET_KEY)
    if not isinstance(value, str):
        return None
    try:
        decoded = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return value if len(decoded.strip()) >= MIN_NODE_SECRET_CHARS else None


def secret(owner: Mapping[str, Any], current: Mapping[str, Any] | None) -> dict[str, Any]:
    """The group's Secret: the value it already holds, or a fresh random one."""
    value = _kept(current) or base64.b64encode(secrets.token_hex(32).encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(owner, secret_name(owner["metadata"]["name"])),
        "type": "Opaque",
        # A changed value would split a running group (old pods, new pods): never in place.
        "immutable": True,
        "data": {SECRET_KEY: value},
    }


def volume(name: str) -> dict[str, Any]:
    return {
        "name": VOLUME,
        "secret": {"secretName": secret_name(name), "defaultMode": FILE_MODE},
    }


def volume_mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MOUNT_DIR, "readOnly": True}


def network_policy(owner: Mapping[str, Any], api_port: int) -> dict[str, Any]:
    """The ModelServer's pods reach each other on every port (node ports and collectives);
    anyone may reach the API port (clients, probes, Prometheus); nothing else gets in."""
    pods = selector_labels(owner["metadata"]["name"])
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(owner, policy_name(owner["metadata"]["name"])),
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": pods}}]},
                {"ports": [{"protocol": "TCP", "port": api_port}]},
            ],
        },
    }
