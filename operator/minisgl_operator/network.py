"""The Service in front of a ModelServer's pods and the optional Ingress."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minisgl_operator.meta import child_metadata
from minisgl_operator.spec import ModelServerSpec
from minisgl_operator.workload import scrape_annotations, serving_selector

SERVICE_PORT = 8000


def service(owner: Mapping[str, Any], spec: ModelServerSpec, container_port: int) -> dict[str, Any]:
    meta = child_metadata(owner)
    meta["annotations"] = scrape_annotations(container_port)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": serving_selector(spec),
            "ports": [
                {"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def tls_secret_name(name: str) -> str:
    return f"{name}-tls"


def ingress(owner: Mapping[str, Any], spec: ModelServerSpec) -> dict[str, Any]:
    ing = spec.ingress
    assert ing is not None
    meta = child_metadata(owner)
    if ing.annotations:
        meta["annotations"] = dict(ing.annotations)
    body: dict[str, Any] = {
        "rules": [
            {
                "host": ing.host,
                "http": {
                    "paths": [
                        {
                            "path": "/",
                            "pathType": "Prefix",
                            "backend": {"service": {"name": spec.name, "port": {"name": "http"}}},
                        }
                    ]
                },
            }
        ]
    }
    if ing.class_name:
        body["ingressClassName"] = ing.class_name
    if ing.tls:
        body["tls"] = [{"hosts": [ing.host], "secretName": tls_secret_name(spec.name)}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": meta,
        "spec": body,
    }


def endpoint(spec: ModelServerSpec) -> str:
    """Where clients reach the OpenAI API: the Ingress when there is one, else the Service."""
    if spec.ingress is not None:
        scheme = "https" if spec.ingress.tls else "http"
        return f"{scheme}://{spec.ingress.host}"
    return f"http://{spec.name}.{spec.namespace}.svc:{SERVICE_PORT}"
