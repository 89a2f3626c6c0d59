"""Kubernetes operator for minisgl: turns a `ModelServer` into the objects that serve it.

The logic lives in plain functions (`spec`, `children`, `status`); `handlers` wires them to
kopf. Importing this package never imports torch.
"""

GROUP = "minisgl.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelServer"
PLURAL = "modelservers"
FIELD_MANAGER = "minisgl-operator"
# Every child carries these so the operator (and users) can find what it made.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MODELSERVER_LABEL = "minisgl.io/modelserver"

__all__ = [
    "API_VERSION",
    "FIELD_MANAGER",
    "GROUP",
    "KIND",
    "MANAGED_BY_LABEL",
    "MODELSERVER_LABEL",
    "PLURAL",
    "VERSION",
]
