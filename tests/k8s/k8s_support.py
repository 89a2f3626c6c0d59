"""Helpers for the Kubernetes tests: the CRD, structural defaulting, schema validation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "minisgl"
CRD_PATH = CHART / "crds" / "modelservers.minisgl.io.yaml"
# The Kubernetes release the manifests are checked against (a recent one kubernetes-validate
# ships; the chart's kubeVersion floor is 1.30).
K8S_VERSION = "1.35"


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def crd_schema() -> dict[str, Any]:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it: fill absent properties that have a
    default, then recurse (so `engine: {}` gets engine.tensorParallelSize)."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        out = dict(obj)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apply_defaults(sub, out[key])
        return out
    if isinstance(obj, list) and "items" in schema:
        return [apply_defaults(schema["items"], x) for x in obj]
    return obj


def _strip_k8s_extensions(schema: Any) -> Any:
    # int-or-string fields are written with anyOf; the x- keys mean nothing to jsonschema.
    if isinstance(schema, dict):
        return {k: _strip_k8s_extensions(v) for k, v in schema.items() if not k.startswith("x-")}
    if isinstance(schema, list):
        return [_strip_k8s_extensions(x) for x in schema]
    return schema


def validate_modelserver(obj: dict[str, Any]) -> dict[str, Any]:
    """Default and validate a ModelServer against the CRD's own schema (OpenAPI 3.0 is
    draft-4 style: boolean exclusiveMinimum). Returns the defaulted object."""
    schema = crd_schema()
    defaulted = apply_defaults(schema, obj)
    jsonschema.Draft4Validator(_strip_k8s_extensions(schema)).validate(defaulted)
    return defaulted


# Upstream CRDs, trimmed (tests/k8s/crds/trim.py): what the real API server checks these by.
VENDORED_CRDS = {
    "LeaderWorkerSet": "leaderworkersets.yaml",
    "InferencePool": "inferencepools.yaml",
    "HTTPRoute": "httproutes.yaml",
}
CRD_DIR = Path(__file__).resolve().parent / "crds"


def vendored_crd(kind: str) -> dict[str, Any]:
    return yaml.safe_load((CRD_DIR / VENDORED_CRDS[kind]).read_text())


def unknown_fields(schema: dict[str, Any], obj: Any, where: str = "") -> list[str]:
    """Fields the schema does not declare: the API server would silently prune them, so a
    misspelt field would be lost without an error."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out: list[str] = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                out += unknown_fields(props[key], value, f"{where}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(extra, value, f"{where}.{key}")
            elif props is not None and where != ".metadata":
                out.append(f"{where}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, x in enumerate(obj):
            out += unknown_fields(schema["items"], x, f"{where}[{i}]")
    return out


def validate_vendored(obj: dict[str, Any]) -> dict[str, Any]:
    """Validate against the upstream CRD: version, schema (after defaulting) and no field it
    would prune. A LeaderWorkerSet's pod templates are checked as core PodTemplates."""
    crd = vendored_crd(obj["kind"])
    group = crd["spec"]["group"]
    (version,) = crd["spec"]["versions"]
    assert obj["apiVersion"] == f"{group}/{version['name']}", obj["apiVersion"]
    schema = version["schema"]["openAPIV3Schema"]
    defaulted = apply_defaults(schema, obj)
    jsonschema.Draft4Validator(_strip_k8s_extensions(schema)).validate(defaulted)
    assert unknown_fields(schema, obj) == []
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key in lwt:
                pod_template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{obj['metadata']['name']}-{key}"},
                    "template": lwt[key],
                }
                kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
    return defaulted


# Kinds from CRDs that kubernetes-validate has no schema for, and what checks them instead.
CUSTOM_KINDS = {"ModelServer", "ScaledObject", "PodMonitor", "ServiceMonitor", "PrometheusRule"}


def validate_k8s(obj: dict[str, Any]) -> None:
    if obj["kind"] == "ModelServer":
        validate_modelserver(obj)
        return
    if obj["kind"] in VENDORED_CRDS:
        validate_vendored(obj)
        return
    if obj["kind"] in CUSTOM_KINDS:
        assert obj["apiVersion"] and obj["metadata"]["name"] and isinstance(obj["spec"], dict)
        return
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
