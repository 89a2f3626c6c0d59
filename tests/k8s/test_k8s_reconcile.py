"""reconcile() against an in-memory API (and HttpKube / Prometheus over mocked HTTP)."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from minisgl_operator import API_VERSION, KIND, prometheus
from minisgl_operator.children import DEPLOYMENT, INGRESS, SERVICE, ChildKind
from minisgl_operator.kube import HttpKube, KubeError
from minisgl_operator.reconcile import Config, reconcile
from minisgl_operator.spec import parse_spec


class FakeKube:
    """Objects by (kind, namespace, name); apply replaces what we own, like SSA with force."""

    def __init__(self, keda: bool = False, apis: tuple[str, ...] = ()) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.status: dict[tuple[str, str], dict[str, Any]] = {}
        self.keda = keda
        self.apis = set(apis)  # plurals of optional CRDs that are installed
        self.fail_apply: set[str] = set()
        self.forbidden: set[str] = set()  # kinds the operator's RBAC does not grant

    async def get(self, kind: ChildKind, namespace: str, name: str) -> dict[str, Any] | None:
        if kind.kind in self.forbidden:
            raise KubeError(403, f"{kind.plural} is forbidden")
        obj = self.objects.get((kind.kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        if obj["kind"] in self.fail_apply:
            raise KubeError(422, f"{obj['kind']} is invalid: admission webhook said no")
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        old = self.objects.get(key)
        new: dict[str, Any] = copy.deepcopy(dict(obj))
        gen = (old or {}).get("metadata", {}).get("generation", 0)
        changed = old is None or {k: v for k, v in old.items() if k != "status"} != {
            **new,
            "metadata": {**new["metadata"], "generation": gen},
        }
        new["metadata"]["generation"] = gen + 1 if changed else gen
        new["status"] = (old or {}).get("status", {})
        self.objects[key] = new
        return copy.deepcopy(new)

    async def delete(self, kind: ChildKind, namespace: str, name: str) -> None:
        self.objects.pop((kind.kind, namespace, name), None)

    async def get_modelserver(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.status.setdefault((namespace, name), {}).update(status)

    async def has_api(self, api_version: str, plural: str) -> bool:
        return self.keda if plural == "scaledobjects" else plural in self.apis

    def kinds(self) -> set[str]:
        return {k for k, _, _ in self.objects}


def ms(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "qwen", "namespace": "llm", "uid": "uid-1", "generation": 1},
        "spec": spec,
    }


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_create_edit_heal_and_prune() -> None:
    kube = FakeKube()
    spec = {"model": "m", "ingress": {"host": "q.example.com"}, "autoscaling": {"maxReplicas": 2}}
    status = run(reconcile(ms(spec), kube, Config()))
    assert kube.kinds() == {"Deployment", "Service", "Ingress", "HorizontalPodAutoscaler"}
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "uid-1" for o in kube.objects.values())
    assert cond(status, "Degraded")["status"] == "False"
    assert kube.status[("llm", "qwen")]["endpoint"] == "http://q.example.com"

    # Re-running changes nothing (idempotent).
    before = copy.deepcopy(kube.objects)
    run(reconcile(ms(spec), kube, Config()))
    assert kube.objects == before

    # A spec edit rolls the pod template.
    spec2 = {**spec, "engine": {"dtype": "bfloat16"}}
    run(reconcile(ms(spec2), kube, Config()))
    dep = kube.objects[("Deployment", "llm", "qwen")]
    assert dep["metadata"]["generation"] == 2
    assert "bfloat16" in dep["spec"]["template"]["spec"]["containers"][0]["command"]

    # A hand-deleted child comes back.
    run(kube.delete(SERVICE, "llm", "qwen"))
    run(reconcile(ms(spec2), kube, Config()))
    assert ("Service", "llm", "qwen") in kube.objects

    # Dropping ingress/autoscaling from the spec removes those children.
    run(reconcile(ms({"model": "m"}), kube, Config()))
    assert kube.kinds() == {"Deployment", "Service"}


def test_invalid_spec_degrades_without_touching_children() -> None:
    kube = FakeKube()
    run(reconcile(ms({"model": "m"}), kube, Config()))
    before = copy.deepcopy(kube.objects)
    status = run(
        reconcile(ms({"model": "m", "engine": {"extraArgs": ["--bogus"]}}), kube, Config())
    )
    d = cond(status, "Degraded")
    assert (d["status"], d["reason"]) == ("True", "InvalidSpec")
    assert "--bogus" in d["message"]
    assert kube.objects == before


def test_unsatisfiable_spec_from_a_cluster_without_cel() -> None:
    kube = FakeKube()
    bad = {"model": "m", "autoscaling": {"minReplicas": 3, "maxReplicas": 1}}
    status = run(reconcile(ms(bad), kube, Config()))
    assert "minReplicas (3) must not exceed maxReplicas (1)" in cond(status, "Degraded")["message"]
    assert kube.objects == {}


def test_refused_apply_is_degraded_and_the_rest_still_applies() -> None:
    kube = FakeKube()
    kube.fail_apply = {"Ingress"}
    status = run(reconcile(ms({"model": "m", "ingress": {"host": "h"}}), kube, Config()))
    d = cond(status, "Degraded")
    assert d["reason"] == "ApplyFailed" and "admission webhook said no" in d["message"]
    assert kube.kinds() == {"Deployment", "Service"}


def test_objects_we_do_not_own_are_left_alone() -> None:
    kube = FakeKube()
    theirs = {"kind": "Service", "metadata": {"name": "qwen", "namespace": "llm"}, "spec": {}}
    kube.objects[("Service", "llm", "qwen")] = theirs
    kube.objects[("Ingress", "llm", "qwen")] = {**theirs, "kind": "Ingress"}
    status = run(reconcile(ms({"model": "m"}), kube, Config()))
    assert cond(status, "Degraded")["reason"] == "NameConflict"
    assert kube.objects[("Service", "llm", "qwen")] is theirs
    assert ("Ingress", "llm", "qwen") in kube.objects  # not pruned: not ours


def test_a_conflicting_deployment_never_counts_as_ours() -> None:
    kube = FakeKube()
    theirs = {
        "kind": "Deployment",
        "metadata": {"name": "qwen", "namespace": "llm", "generation": 1},
        "spec": {"replicas": 3},
        "status": {"replicas": 3, "readyReplicas": 3, "availableReplicas": 3},
    }
    kube.objects[("Deployment", "llm", "qwen")] = theirs
    status = run(reconcile(ms({"model": "m"}), kube, Config()))
    degraded = cond(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "NameConflict")
    ready = cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert cond(status, "Progressing")["status"] == "False"
    assert (status["replicas"], status["readyReplicas"], status["replicaSummary"]) == (0, 0, "0/0")
    assert status["endpoint"] is None
    assert kube.objects[("Deployment", "llm", "qwen")] is theirs


def test_abbreviated_extra_args_are_degraded_not_applied() -> None:
    kube = FakeKube()
    for extra, why in (
        (["--tp", "4"], "unrecognized arguments: --tp 4"),
        (["--hos", "127.0.0.1"], "unrecognized arguments: --hos"),
        (["--tp-size=4"], "may not set --tp-size"),
    ):
        status = run(reconcile(ms({"model": "m", "engine": {"extraArgs": extra}}), kube, Config()))
        d = cond(status, "Degraded")
        assert (d["status"], d["reason"]) == ("True", "InvalidSpec") and why in d["message"]
        assert kube.objects == {}


def test_keda_switch_and_missing_prometheus() -> None:
    kube = FakeKube(keda=True)
    spec = {"model": "m", "autoscaling": {"maxReplicas": 3}}
    status = run(reconcile(ms(spec), kube, Config()))
    assert cond(status, "Degraded")["reason"] == "AutoscalingUnavailable"
    assert "Deployment" in kube.kinds()
    status = run(reconcile(ms(spec), kube, Config(prometheus_url="http://prom:9090")))
    assert "ScaledObject" in kube.kinds() and "HorizontalPodAutoscaler" not in kube.kinds()
    assert cond(status, "Degraded")["status"] == "False"


# --- HttpKube: the requests that reach the API server.


def http_kube(handler: Any) -> HttpKube:
    transport = httpx.MockTransport(handler)
    return HttpKube(httpx.AsyncClient(base_url="https://k8s.local", transport=transport))


def test_apply_is_server_side_apply_with_our_field_manager() -> None:
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return httpx.Response(200, json=json.loads(req.content))

    kube = http_kube(handler)
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "q", "namespace": "llm"},
    }
    assert run(kube.apply(obj)) == obj
    (req,) = seen
    assert req.method == "PATCH"
    assert req.url.path == "/apis/apps/v1/namespaces/llm/deployments/q"
    assert req.url.params["fieldManager"] == "minisgl-operator"
    assert req.url.params["force"] == "true"
    assert req.headers["content-type"] == "application/apply-patch+yaml"
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "q", "namespace": "llm"}}
    run(kube.apply(svc))
    assert seen[-1].url.path == "/api/v1/namespaces/llm/services/q"


def test_get_404_delete_status_and_discovery() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        p = req.url.path
        if p.endswith("/ingresses/gone"):
            return httpx.Response(404, json={"message": "not found"})
        if p == "/apis/keda.sh/v1alpha1":
            return httpx.Response(200, json={"resources": [{"name": "scaledobjects"}]})
        if p == "/apis/nope/v1":
            return httpx.Response(404)
        if p.endswith("/status"):
            assert req.headers["content-type"] == "application/merge-patch+json"
            assert json.loads(req.content) == {"status": {"replicas": 1}}
            return httpx.Response(200, json={})
        if req.method == "DELETE":
            assert json.loads(req.content)["propagationPolicy"] == "Background"
            return httpx.Response(200, json={})
        return httpx.Response(403, json={"message": "forbidden: no RBAC"})

    kube = http_kube(handler)
    assert run(kube.get(INGRESS, "llm", "gone")) is None
    assert run(kube.has_api("keda.sh/v1alpha1", "scaledobjects")) is True
    assert run(kube.has_api("keda.sh/v1alpha1", "scaledjobs")) is False
    assert run(kube.has_api("nope/v1", "x")) is False
    run(kube.patch_status("llm", "qwen", {"replicas": 1}))
    run(kube.delete(DEPLOYMENT, "llm", "qwen"))
    with pytest.raises(KubeError, match="403.*no RBAC"):
        run(kube.get(SERVICE, "llm", "x"))


def test_http_errors_surface_as_degraded_not_crashes() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.method == "GET" and "/apis/keda.sh" in req.url.path:
            return httpx.Response(404)
        if req.method == "GET":
            return httpx.Response(404, json={"message": "not found"})
        if req.method == "PATCH" and not req.url.path.endswith("/status"):
            return httpx.Response(422, json={"message": "Deployment.apps is invalid"})
        return httpx.Response(200, json={})

    status = run(reconcile(ms({"model": "m"}), http_kube(handler), Config()))
    assert "Deployment.apps is invalid" in cond(status, "Degraded")["message"]


# --- Prometheus: observed SLOs for the status.


def test_observe_reads_the_three_slos() -> None:
    answers = {"time_to_first_token": "0.42", "time_per_output_token": "NaN", "waiting": "3"}

    def handler(req: httpx.Request) -> httpx.Response:
        q = req.url.params["query"]
        assert req.url.path == "/api/v1/query"
        assert 'minisgl_io_modelserver="qwen"' in q and 'namespace="llm"' in q
        value = next(v for k, v in answers.items() if k in q)
        body = {
            "status": "success",
            "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, value]}]},
        }
        return httpx.Response(200, json=body)

    spec = parse_spec("qwen", "llm", {"model": "m", "servedModelName": "qwen-chat"})

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await prometheus.observe(client, "http://prom:9090/", spec)

    assert run(go()) == {"ttftP95Seconds": 0.42, "tpotP95Seconds": None, "waitingRequests": 3.0}


def test_first_value_edge_cases() -> None:
    assert prometheus.first_value({"status": "error"}) is None
    assert prometheus.first_value({"status": "success", "data": {"result": []}}) is None
    ok = {"status": "success", "data": {"result": [{"value": [1, "+Inf"]}]}}
    assert prometheus.first_value(ok) is None
