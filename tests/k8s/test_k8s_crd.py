"""The ModelServer CRD: shape, its schema on example resources, and its CEL rules."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_support import (
    CRD_PATH,
    K8S_VERSION,
    ROOT,
    apply_defaults,
    crd_schema,
    load_crd,
    validate_modelserver,
)
from minisgl_operator import API_VERSION, KIND, PLURAL, spec

from minisgl.config import DTYPES, ServerArgs

EXAMPLES = sorted((ROOT / "examples").glob("modelserver*.yaml"))
GOOD = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "m"}}


def ms(spec_: dict[str, Any], name: str = "m") -> dict[str, Any]:
    return {**copy.deepcopy(GOOD), "metadata": {"name": name}, "spec": spec_}


def test_crd_is_a_valid_kubernetes_object() -> None:
    crd = load_crd()
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    assert crd["metadata"]["name"] == f"{PLURAL}.minisgl.io"
    assert crd["spec"]["scope"] == "Namespaced"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas"
    assert scale["labelSelectorPath"] == ".status.selector"
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Model",
        "Ready",
        "Replicas",
        "Nodes",
        "Routing",
        "TTFT-P95",
        "Endpoint",
        "Age",
    ]


def test_schema_is_structural() -> None:
    # Every node has a type (or is int-or-string / preserve-unknown): what the API server needs
    # to prune and default.
    def walk(node: dict[str, Any], where: str) -> None:
        ok = (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        )
        assert ok, f"{where} has no type"
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{where}.{key}")
        if "items" in node:
            walk(node["items"], f"{where}[]")

    walk(crd_schema(), "")


def test_crd_defaults_match_the_operator() -> None:
    s = crd_schema()["properties"]["spec"]["properties"]
    assert s["image"]["default"] == spec.DEFAULT_IMAGE
    assert s["replicas"]["default"] == spec.DEFAULT_REPLICAS
    assert s["startupTimeoutSeconds"]["default"] == spec.DEFAULT_STARTUP_TIMEOUT_S
    engine = s["engine"]["properties"]
    assert engine["tensorParallelSize"]["default"] == spec.DEFAULT_TP_SIZE == ServerArgs.tp_size
    assert tuple(engine["dtype"]["enum"]) == DTYPES
    assert "default" not in engine["dtype"]  # minisgl's own default applies
    assert s["modelCache"]["properties"]["size"]["default"] == spec.DEFAULT_CACHE_SIZE
    auto = s["autoscaling"]["properties"]
    assert auto["minReplicas"]["default"] == spec.DEFAULT_MIN_REPLICAS
    assert auto["targets"]["default"] == spec.DEFAULT_TARGETS
    assert auto["scaleUpStabilizationSeconds"]["default"] == spec.DEFAULT_SCALE_UP_STABILIZATION_S
    assert (
        auto["scaleDownStabilizationSeconds"]["default"] == spec.DEFAULT_SCALE_DOWN_STABILIZATION_S
    )


def test_defaulted_and_raw_specs_parse_the_same() -> None:
    for path in EXAMPLES:
        obj = yaml.safe_load(path.read_text())
        defaulted = apply_defaults(crd_schema(), obj)
        raw = spec.parse_spec(obj["metadata"]["name"], "ns", obj["spec"])
        assert spec.parse_spec(obj["metadata"]["name"], "ns", defaulted["spec"]) == raw


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_pass_the_crd_schema_and_the_operator(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    validate_modelserver(obj)
    assert not cel_failures(obj)
    spec.parse_spec(obj["metadata"]["name"], "default", obj["spec"])


BAD_SCHEMA = {
    "no model": {"replicas": 1},
    "empty model": {"model": ""},
    "negative replicas": {"model": "m", "replicas": -1},
    "tp zero": {"model": "m", "engine": {"tensorParallelSize": 0}},
    "unknown dtype": {"model": "m", "engine": {"dtype": "int4"}},
    "string pages": {"model": "m", "engine": {"numPages": "many"}},
    "extra args not strings": {"model": "m", "engine": {"extraArgs": [1, 2]}},
    "gpus negative": {"model": "m", "resources": {"gpus": -1}},
    "no max replicas": {"model": "m", "autoscaling": {"minReplicas": 1}},
    "zero target": {
        "model": "m",
        "autoscaling": {"maxReplicas": 2, "targets": {"ttftP95Seconds": 0}},
    },
    "startup too short": {"model": "m", "startupTimeoutSeconds": 5},
    "ingress without host": {"model": "m", "ingress": {"tls": True}},
    "bad toleration": {"model": "m", "tolerations": [{"operator": "Maybe"}]},
    "env without name": {"model": "m", "env": [{"value": "x"}]},
    "prometheus url": {"model": "m", "autoscaling": {"maxReplicas": 2, "prometheusUrl": "p:9090"}},
    # Quantities: refused here, not later by the Deployment or claim they would become.
    "a memory that is no quantity": {"model": "m", "resources": {"memory": "lots"}},
    "a negative cpu": {"model": "m", "resources": {"cpu": "-1"}},
    "a negative integer cpu": {"model": "m", "resources": {"cpu": -2}},
    "a negative fractional cpu": {"model": "m", "resources": {"cpu": -0.5}},
    "a cpu that is a boolean": {"model": "m", "resources": {"cpu": True}},
    "a memory that is an object": {"model": "m", "resources": {"memory": {"gi": 2}}},
    "a memory that is a list": {"model": "m", "resources": {"memory": []}},
    "shared memory in lowercase units": {"model": "m", "resources": {"sharedMemory": "2gi"}},
    "a fractional cache size": {"model": "m", "modelCache": {"size": 0.5}},
}


@pytest.mark.parametrize("bad", BAD_SCHEMA.values(), ids=BAD_SCHEMA.keys())
def test_bad_specs_fail_the_schema_and_the_operator(bad: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate_modelserver(ms(bad))
    with pytest.raises(spec.SpecError):
        spec.parse_spec("m", "ns", bad)


def test_bad_example_files_fail() -> None:
    files = sorted((Path(__file__).parent / "bad").glob("*.yaml"))
    assert files
    for path in files:
        obj = yaml.safe_load(path.read_text())
        schema_ok = True
        try:
            validate_modelserver(obj)
        except jsonschema.ValidationError:
            schema_ok = False
        assert not schema_ok or cel_failures(obj), path.name
        with pytest.raises(spec.SpecError):
            spec.parse_spec(obj["metadata"]["name"], "ns", obj["spec"])


# --- CEL (x-kubernetes-validations), evaluated with cel-python the way the API server does:
# each rule sees `self` = the node it sits on, after defaulting.


def _rules(schema: dict[str, Any], path: tuple[str, ...] = ()):
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule
    for key, sub in (schema.get("properties") or {}).items():
        yield from _rules(sub, (*path, key))


def cel_failures(obj: dict[str, Any]) -> list[str]:
    schema = crd_schema()
    defaulted = apply_defaults(schema, obj)
    env = celpy.Environment()
    failed = []
    for path, rule in _rules(schema):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: the API server runs it on updates only
        node: Any = defaulted
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue  # rules on absent objects do not run
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(node)})):
            failed.append(rule["message"])
    return failed


CEL_CASES = {
    "min above max": (
        {"model": "m", "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
        "minReplicas must not exceed",
    ),
    "fewer gpus than tp": (
        {"model": "m", "engine": {"tensorParallelSize": 4}, "resources": {"gpus": 2}},
        "at least engine.tensorParallelSize",
    ),
    "empty targets": (
        {"model": "m", "autoscaling": {"maxReplicas": 2, "targets": {}}},
        "at least one target",
    ),
    "tp not divisible by nodes": (
        {"model": "m", "engine": {"tensorParallelSize": 6, "nodes": 4}},
        "must divide by engine.nodes",
    ),
    "fewer gpus than the ranks of one pod": (
        {
            "model": "m",
            "engine": {"tensorParallelSize": 16, "nodes": 2},
            "resources": {"gpus": 4},
        },
        "at least engine.tensorParallelSize / engine.nodes",
    ),
    "gateway without pool": (
        {"model": "m", "routing": {"gatewayRef": {"name": "gw"}}},
        "needs routing.inferencePool",
    ),
    "eagle3 without its draft head": (
        {"model": "m", "engine": {"speculative": {"algorithm": "eagle3"}}},
        "draftModelPath is required with algorithm eagle3",
    ),
    "a draft head for ngram": (
        {"model": "m", "engine": {"speculative": {"algorithm": "ngram", "draftModelPath": "d"}}},
        "draftModelPath is for algorithm eagle3 only",
    ),
    "a cache size that is no quantity": (
        {"model": "m", "modelCache": {"size": "big"}},
        "must be a Kubernetes quantity",
    ),
    "a negative cache size": (
        {"model": "m", "modelCache": {"size": -1}},
        "must be a Kubernetes quantity",
    ),
    # Names the children carry: refused here, not by the Deployment, claim or Ingress.
    "a token Secret that is no name": (
        {"model": "m", "hfTokenSecret": "HF_Token"},
        "must be a Kubernetes object name",
    ),
    "a storage class with a space": (
        {"model": "m", "modelCache": {"storageClassName": "fast ssd"}},
        "must be a Kubernetes object name",
    ),
    "an existing claim in capitals": (
        {"model": "m", "modelCache": {"existingClaim": "Weights"}},
        "must be a Kubernetes object name",
    ),
    "an ingress host with a space": (
        {"model": "m", "ingress": {"host": "qwen example.com"}},
        "must be a lowercase DNS name",
    ),
    "an ingress class in capitals": (
        {"model": "m", "ingress": {"host": "q.example.com", "className": "NGINX"}},
        "must be a Kubernetes object name",
    ),
    "a gateway namespace with a dot": (
        {
            "model": "m",
            "routing": {"inferencePool": True, "gatewayRef": {"name": "gw", "namespace": "a.b"}},
        },
        "must be a namespace name",
    ),
}


@pytest.mark.parametrize("bad,message", CEL_CASES.values(), ids=CEL_CASES.keys())
def test_cel_rules_reject_and_the_operator_agrees(bad: dict[str, Any], message: str) -> None:
    obj = ms(bad)
    validate_modelserver(obj)  # schema-valid: only the cross-field rule catches it
    failures = cel_failures(obj)
    assert any(message in f for f in failures), failures
    with pytest.raises(spec.SpecError):
        spec.parse_spec("m", "ns", bad)


def test_cel_rules_accept_edge_cases() -> None:
    for good in (
        {"model": "m", "autoscaling": {"minReplicas": 2, "maxReplicas": 2}},
        {"model": "m", "engine": {"tensorParallelSize": 4}, "resources": {"gpus": 0}},
        {"model": "m", "engine": {"tensorParallelSize": 2}, "resources": {"gpus": 2}},
        {"model": "m", "engine": {"tensorParallelSize": 2}},
        {"model": "m", "autoscaling": {"maxReplicas": 3}},  # default target
        {"model": "m", "engine": {"tensorParallelSize": 16, "nodes": 2}},
        {"model": "m", "engine": {"tensorParallelSize": 16, "nodes": 2}, "resources": {"gpus": 8}},
        {"model": "m", "routing": {"inferencePool": True, "gatewayRef": {"name": "gw"}}},
        {"model": "m", "resources": {"cpu": 4, "memory": "24Gi", "sharedMemory": "1.5Gi"}},
        {"model": "m", "resources": {"cpu": "500m", "memory": "1e9"}, "modelCache": {}},
        {"model": "m", "resources": {"cpu": "+2", "memory": 0}, "modelCache": {"size": "1Ti"}},
        {"model": "m", "resources": {"cpu": 0.5, "memory": 1024}, "modelCache": {"size": 10**11}},
        {"model": "m", "hfTokenSecret": "hf-token.v2", "modelCache": {"storageClassName": ""}},
        {"model": "m", "modelCache": {"existingClaim": "weights", "storageClassName": "rwx"}},
        {"model": "m", "ingress": {"host": "*.example.com", "className": "nginx"}},
        {
            "model": "m",
            "routing": {"inferencePool": True, "gatewayRef": {"name": "gw.v1", "namespace": "gw"}},
        },
    ):
        validate_modelserver(ms(good))
        assert cel_failures(ms(good)) == []
        spec.parse_spec("m", "ns", good)


def test_long_names_are_rejected_by_cel_and_the_operator() -> None:
    name = "a" * (spec.MAX_NAME_LEN + 1)
    assert cel_failures(ms({"model": "m"}, name=name))
    with pytest.raises(spec.SpecError):
        spec.parse_spec(name, "ns", {"model": "m"})
    assert not cel_failures(ms({"model": "m"}, name="a" * spec.MAX_NAME_LEN))


# --- descriptions: every field explains itself, from the same declaration the operator parses


def _fields(node: dict[str, Any], where: str):
    for key, sub in (node.get("properties") or {}).items():
        yield f"{where}.{key}", sub
        yield from _fields(sub, f"{where}.{key}")
    if "items" in node:
        yield from _fields(node["items"], f"{where}[]")


def test_every_spec_and_status_field_has_a_description() -> None:
    root = crd_schema()
    # metadata is the API server's own (it forbids a schema there beyond its type).
    fields = [f for f in _fields(root, "") if f[0] != ".metadata"]
    missing = [where for where, sub in fields if not str(sub.get("description", "")).strip()]
    assert not missing, f"fields without a description (kubectl explain): {missing}"
    assert len([w for w in fields if w[0].startswith(".spec.")]) >= 50
    assert len([w for w in fields if w[0].startswith(".status.")]) >= 15


def test_chart_crd_is_rendered_from_the_schema() -> None:
    from minisgl_operator import crd

    assert CRD_PATH.read_text() == crd.render(), (
        "the chart's CRD is stale: run `python -m minisgl_operator.crd --write`"
    )


def test_descriptions_name_the_flag_and_the_default() -> None:
    s = crd_schema()["properties"]["spec"]["properties"]
    engine = s["engine"]["properties"]
    assert "`--num-pages`" in engine["numPages"]["description"]
    assert "Default: 1." in engine["tensorParallelSize"]["description"]
    assert "Default: 256." in engine["maxRunningRequests"]["description"]  # minisgl's own
    assert "Default: 1800." in s["startupTimeoutSeconds"]["description"]


def _set(raw: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, key = path.split(".")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
    node[key] = value
    return raw


def _bounded_integers(node: dict[str, Any], where: str = ""):
    for key, sub in (node.get("properties") or {}).items():
        path = f"{where}{key}"
        if sub.get("type") == "integer" and ("minimum" in sub or "maximum" in sub):
            yield path, sub.get("minimum"), sub.get("maximum")
        yield from _bounded_integers(sub, f"{path}.")


def test_the_operator_enforces_every_bound_the_crd_declares() -> None:
    bounded = list(_bounded_integers(crd_schema()["properties"]["spec"]))
    assert len(bounded) >= 12
    for path, lo, hi in bounded:

        def raw(value: int, path: str = path) -> dict[str, Any]:
            base: dict[str, Any] = {"model": "m", "autoscaling": {"maxReplicas": 5}}
            if path.startswith("resources."):
                base["engine"] = {"tensorParallelSize": 1}
            if path == "engine.nodes":  # every node count in bounds divides this TP size
                base["engine"] = {"tensorParallelSize": 64}
            if path.startswith("engine.speculative."):
                base["engine"] = {"speculative": {"algorithm": "ngram"}}
            return _set(base, path, value)

        for ok in (lo, hi):
            if ok is not None:
                spec.parse_spec("m", "ns", raw(ok))
                validate_modelserver(ms(raw(ok)))
        for bad in ((lo - 1) if lo is not None else None, (hi + 1) if hi is not None else None):
            if bad is None:
                continue
            with pytest.raises(spec.SpecError, match=path):
                spec.parse_spec("m", "ns", raw(bad))
            with pytest.raises(jsonschema.ValidationError):
                validate_modelserver(ms(raw(bad)))


def test_the_status_the_operator_writes_is_all_declared() -> None:
    from minisgl_operator.status import compute_status

    owner = {"metadata": {"name": "q", "namespace": "ns", "generation": 1}}
    deployment = {"metadata": {"generation": 1}, "spec": {"replicas": 1}, "status": {}}
    status = compute_status(owner, spec.parse_spec("q", "ns", {"model": "m"}), deployment, [], "t")
    declared = crd_schema()["properties"]["status"]["properties"]
    assert set(status) <= set(declared)
    condition = declared["conditions"]["items"]["properties"]
    assert all(set(c) <= set(condition) for c in status["conditions"])


def test_multi_node_name_rule_agrees_with_the_operator() -> None:
    multi = {"model": "m", "engine": {"tensorParallelSize": 2, "nodes": 2}}
    long_name = "q" * 46
    assert any("at most 45 characters" in f for f in cel_failures(ms(multi, long_name)))
    with pytest.raises(spec.SpecError, match="at most 45"):
        spec.parse_spec(long_name, "ns", multi)
    assert cel_failures(ms(multi, "q" * 45)) == []
    assert cel_failures(ms({"model": "m"}, "q" * 57)) == []


# --- what only a real API server enforced until it was tested against one (issue 23)


def test_metadata_schema_is_only_its_type() -> None:
    # A real API server rejects the CRD otherwise ("must not specify anything other than name
    # and generateName").
    assert crd_schema()["properties"]["metadata"] == {"type": "object"}


def _defaults_with_rules(node: dict[str, Any], where: str = ""):
    if "default" in node and node.get("x-kubernetes-validations"):
        yield where, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _defaults_with_rules(sub, f"{where}.{key}")


def test_declared_defaults_satisfy_their_own_cel_rules() -> None:
    """The API server evaluates an object's CEL rules against its declared default as written
    (nested defaults are not applied inside it) and rejects the CRD if one fails."""
    found = list(_defaults_with_rules(crd_schema()))
    assert [where for where, _ in found] == [
        ".spec.engine",
        ".spec.modelCache.size",
        ".spec.autoscaling.targets",
    ]
    env = celpy.Environment()
    for where, node in found:
        for rule in node["x-kubernetes-validations"]:
            program = env.program(env.compile(rule["rule"]))
            value = celpy.json_to_cel(node["default"])
            try:
                ok = bool(program.evaluate({"self": value}))
            except celpy.CELEvalError as e:  # e.g. "no such key", as the API server says
                raise AssertionError(f"{where}: {rule['rule']} on its default: {e}") from e
            assert ok, f"{where}: {rule['rule']} fails on its default {node['default']}"
