"""Against a real API server (k8s_cluster): what users run, not stand-ins for it.

The CRD as the API server validates and defaults it, `helm install` / `helm uninstall` of the
chart, and the operator as installed, authenticated with the chart's ServiceAccount, through a
ModelServer's life, with the upstream LeaderWorkerSet, InferencePool and Gateway API CRDs. The
control plane has no kubelet: pods stay Pending, which is all the operator needs to be tested.

Without a cluster these skip, except under CI, where they fail (conftest).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import pytest
import yaml
from k8s_cluster import (
    CRD_ROOT,
    Api,
    Operator,
    RecordingProxy,
    install_modelserver_crd,
    namespace,
    service_account_kubeconfig,
    wait_for,
)
from k8s_support import CHART, ROOT
from minisgl_operator import API_VERSION, GROUP, KIND, PLURAL, VERSION, node_security, spec
from minisgl_operator.children import KINDS, Cluster, plan

from minisgl.testing.live_server import free_port

pytestmark = pytest.mark.k8s

RELEASE = "minisgl"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
BAD_FILES = sorted((Path(__file__).parent / "bad").glob("*.yaml"))
MS_ROOT = f"/apis/{GROUP}/{VERSION}"


def ms_path(ns: str, name: str = "") -> str:
    return f"{MS_ROOT}/namespaces/{ns}/{PLURAL}" + (f"/{name}" if name else "")


def modelserver(ns: str, name: str, spec_: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": spec_,
    }


@pytest.fixture(scope="module")
def crd(cluster: Api) -> dict[str, Any]:
    return install_modelserver_crd(cluster)


# --- the CRD ----------------------------------------------------------------------------------


def test_the_api_server_accepts_the_crd_and_defaults_a_minimal_modelserver(
    cluster: Api, crd: dict[str, Any]
) -> None:
    with namespace(cluster, "crd") as ns:
        created = cluster.create(modelserver(ns, "minimal", {"model": "Qwen/Qwen3-0.6B"}))
        assert created.status_code == 201, created.text
        got = cluster.get(ms_path(ns, "minimal"))
        assert got is not None
        assert got["spec"] == {
            "model": "Qwen/Qwen3-0.6B",
            "image": spec.DEFAULT_IMAGE,
            "replicas": spec.DEFAULT_REPLICAS,
            "startupTimeoutSeconds": spec.DEFAULT_STARTUP_TIMEOUT_S,
            "engine": {"tensorParallelSize": spec.DEFAULT_TP_SIZE, "nodes": spec.DEFAULT_NODES},
        }
        # What the API server stored parses to what the operator makes of the raw spec.
        assert spec.parse_spec("minimal", ns, got["spec"]) == spec.parse_spec(
            "minimal", ns, {"model": "Qwen/Qwen3-0.6B"}
        )
        assert cluster.delete(ms_path(ns, "minimal")).status_code == 200
        autoscaled = {"model": "m", "autoscaling": {"maxReplicas": 2}}
        got = cluster.create(modelserver(ns, "auto", autoscaled), dry_run=True).json()
        assert got["spec"]["autoscaling"] == {
            "maxReplicas": 2,
            "minReplicas": spec.DEFAULT_MIN_REPLICAS,
            "targets": spec.DEFAULT_TARGETS,
            "scaleUpStabilizationSeconds": spec.DEFAULT_SCALE_UP_STABILIZATION_S,
            "scaleDownStabilizationSeconds": spec.DEFAULT_SCALE_DOWN_STABILIZATION_S,
        }


REJECTED = {
    "tp not divisible by nodes": (
        {"model": "m", "engine": {"tensorParallelSize": 6, "nodes": 4}},
        "must divide by engine.nodes",
    ),
    "fewer gpus than tp": (
        {"model": "m", "engine": {"tensorParallelSize": 4}, "resources": {"gpus": 2}},
        "at least engine.tensorParallelSize",
    ),
    "min above max": (
        {"model": "m", "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
        "minReplicas must not exceed",
    ),
    "gateway without pool": (
        {"model": "m", "routing": {"gatewayRef": {"name": "gw"}}},
        "needs routing.inferencePool",
    ),
    "unknown field": ({"model": "m", "replica": 2}, 'unknown field "spec.replica"'),
    "memory no quantity": (
        {"model": "m", "resources": {"memory": "lots"}},
        "spec.resources.memory in body should match",
    ),
    "negative cpu": (
        {"model": "m", "resources": {"cpu": -1}},
        "spec.resources.cpu in body should be greater than or equal to 0",
    ),
    "negative fractional cpu": (
        {"model": "m", "resources": {"cpu": -0.5}},
        "spec.resources.cpu in body should be greater than or equal to 0",
    ),
    "boolean cpu": ({"model": "m", "resources": {"cpu": True}}, '"spec.resources.cpu" must not'),
    "object memory": ({"model": "m", "resources": {"memory": {"gi": 2}}}, "spec.resources.memory"),
    "token secret no name": (
        {"model": "m", "hfTokenSecret": "HF_Token"},
        'spec.hfTokenSecret: Invalid value: "HF_Token": must be a Kubernetes object name',
    ),
    "ingress host with a space": (
        {"model": "m", "ingress": {"host": "qwen example.com"}},
        "must be a lowercase DNS name",
    ),
    "startup timeout past a day": (
        {"model": "m", "startupTimeoutSeconds": 2**31 - 1},
        "should be less than or equal to 86400",
    ),
    "cache size no quantity": (
        {"model": "m", "modelCache": {"size": "10gi"}},
        "must be a Kubernetes quantity",
    ),
    "fractional cache size": (
        {"model": "m", "modelCache": {"size": 0.5}},
        "spec.modelCache.size in body must be of type integer,string",
    ),
}


def test_the_api_server_rejects_what_the_crd_forbids(cluster: Api, crd: dict[str, Any]) -> None:
    for what, (bad, message) in REJECTED.items():
        resp = cluster.create(modelserver("default", "bad", bad), dry_run=True)
        # 422: schema or CEL; 400: a field the schema does not declare (strict validation).
        assert resp.status_code in (400, 422), (what, resp.text)
        assert message in resp.json()["message"], (what, resp.text)
    resp = cluster.create(modelserver("default", "m" * 58, {"model": "m"}), dry_run=True)
    assert resp.status_code == 422, resp.text
    assert "at most 57 characters" in resp.json()["message"]
    assert BAD_FILES
    for path in BAD_FILES:
        obj = yaml.safe_load(path.read_text())
        obj["metadata"]["namespace"] = "default"
        resp = cluster.create(obj, dry_run=True)
        assert resp.status_code == 422, (path.name, resp.text)


NUMERIC_QUANTITIES = {
    "cpu": 0.5,
    "memory": 1024,
    "sharedMemory": 1.5e9,
}


def test_quantities_written_as_numbers_are_accepted_and_rendered(
    cluster: Api, crd: dict[str, Any]
) -> None:
    """`cpu: 0.5` in YAML is a number, and a Pod takes it: so does a ModelServer, and the
    Deployment and claim the operator renders from it are accepted as well."""
    raw = {
        "model": "m",
        "resources": {**NUMERIC_QUANTITIES, "gpus": 0},
        "modelCache": {"size": 100_000_000_000},  # bytes: a whole number
    }
    resp = cluster.create(modelserver("default", "numbers", raw), dry_run=True)
    assert resp.status_code == 201, resp.text
    stored = resp.json()
    assert stored["spec"]["resources"] == {**NUMERIC_QUANTITIES, "gpus": 0}
    stored["metadata"]["uid"] = "00000000-0000-0000-0000-000000000002"
    children = {c["kind"]: c for c in plan(stored, Cluster()).apply}
    for kind in ("Deployment", "PersistentVolumeClaim"):
        children[kind]["metadata"].pop("ownerReferences")  # no owner in a dry run
        resp = cluster.create(children[kind], dry_run=True)
        assert resp.status_code == 201, (kind, resp.text)
        if kind == "Deployment":
            pod = resp.json()["spec"]["template"]["spec"]
            (server,) = [c for c in pod["containers"] if c["name"] == "server"]
            assert server["resources"]["requests"] == {"cpu": "500m", "memory": "1024"}
            (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
            assert shm["emptyDir"]["sizeLimit"] == "1500M"
        else:
            assert resp.json()["spec"]["resources"]["requests"]["storage"] == "100G"


def _edit(cluster: Api, ns: str, name: str, spec_: dict[str, Any]) -> httpx.Response:
    """What `kubectl edit` / `kubectl apply` send: a merge patch of the spec."""
    return cluster.client.patch(
        ms_path(ns, name),
        headers={"Content-Type": "application/merge-patch+json"},
        json={"spec": spec_},
    )


def test_a_cache_claims_class_and_size_only_change_as_a_claim_can(
    cluster: Api, crd: dict[str, Any]
) -> None:
    """A claim's storageClassName is immutable and its size cannot shrink: an edit that asks
    for either is refused at admission (else the claim is refused on every reconcile and the
    ModelServer stays Degraded), while growing it, bringing an existingClaim or removing the
    cache stay allowed."""
    with namespace(cluster, "cache") as ns:
        cache = {"size": "20Gi", "storageClassName": "fast"}
        resp = cluster.create(modelserver(ns, "c", {"model": "m", "modelCache": cache}))
        assert resp.status_code == 201, resp.text
        refused = {
            "another class": ({"storageClassName": "slow"}, "storageClassName cannot change"),
            "the default class": ({"storageClassName": None}, "storageClassName cannot change"),
            "a smaller size": ({"size": "10Gi"}, "modelCache.size cannot shrink"),
            "fewer bytes": ({"size": 20 * 2**30 - 1}, "modelCache.size cannot shrink"),
        }
        for what, (change, message) in refused.items():
            resp = _edit(cluster, ns, "c", {"modelCache": change})
            assert resp.status_code == 422, (what, resp.text)
            assert message in resp.json()["message"], (what, resp.text)
        for allowed in (
            {"size": "21474836480"},  # the same size, in bytes
            {"size": "30Gi"},
            {"size": 40 * 2**30, "storageClassName": "fast"},
            {"existingClaim": "weights", "storageClassName": "slow", "size": "1Gi"},
        ):
            resp = _edit(cluster, ns, "c", {"modelCache": allowed})
            assert resp.status_code == 200, (allowed, resp.text)
        resp = _edit(cluster, ns, "c", {"modelCache": None})
        assert resp.status_code == 200, resp.text
        resp = _edit(cluster, ns, "c", {"modelCache": {"size": "5Gi", "storageClassName": "x"}})
        assert resp.status_code == 200, resp.text


# --- the chart, installed with real Helm ------------------------------------------------------


def release_objects(manifest: str) -> list[dict[str, Any]]:
    return [o for o in yaml.safe_load_all(manifest) if o]


def helm_config(ns: str) -> helm.Config:
    return helm.Config(kubeconfig_path=os.environ.get("KUBECONFIG"), namespace=ns)


def install(cluster: Api, ns: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    release = helm_config(ns).install(str(CHART), RELEASE, values, namespace=ns, timeout=120)
    assert release["status"] == "deployed", release
    objs = release_objects(release["manifest"])
    for obj in objs:  # what Helm reports installed is there
        assert cluster.get(cluster.path(obj)) is not None, obj["metadata"]
    return objs


def uninstall(cluster: Api, ns: str, objs: list[dict[str, Any]]) -> None:
    helm_config(ns).uninstall(RELEASE, timeout=120)
    for obj in objs:
        wait_for(f"{obj['kind']} {obj['metadata']['name']} to go", lambda o=obj: _gone(cluster, o))
    # Nothing else of the release: no pods of its operator, no release record.
    pods = f"/api/v1/namespaces/{ns}/pods?labelSelector=app.kubernetes.io/instance={RELEASE}"
    wait_for("the operator's pods to go", lambda: not (cluster.get(pods) or {})["items"])
    records = f"/api/v1/namespaces/{ns}/secrets?labelSelector=owner=helm,name={RELEASE}"
    assert (cluster.get(records) or {})["items"] == []
    assert cluster.get(f"{CRD_ROOT}/{PLURAL}.{GROUP}") is not None  # CRDs stay, as in Helm


def _gone(cluster: Api, obj: dict[str, Any]) -> bool:
    return cluster.get(cluster.path(obj)) is None


def dry_run_examples(cluster: Api, ns: str) -> None:
    assert len(EXAMPLES) >= 5
    for path in EXAMPLES:
        for obj in yaml.safe_load_all(path.read_text()):
            obj["metadata"]["namespace"] = ns
            resp = cluster.create(obj, dry_run=True)
            assert resp.status_code == 201, (path.name, resp.text)


def installed_operator(cluster: Api, ns: str, liveness: str) -> tuple[list[str], dict[str, str]]:
    """The operator's command line and environment as the chart's Deployment runs it (its
    liveness endpoint moved to a free local port)."""
    dep = cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{RELEASE}-operator")
    assert dep is not None
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    args = [a for a in container["args"] if not a.startswith("--liveness=")]
    assert len(args) == len(container["args"]) - 1
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    return [f"--liveness={liveness}", *args], env


def _live(url: str, operator: Operator) -> bool:
    if operator.proc.poll() is not None:
        raise AssertionError(f"the operator exited:\n{operator.log()}")
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def operator_as_installed(
    cluster: Api, ns: str, tmp: Path, proxy: RecordingProxy | None = None
) -> Iterator[Operator]:
    """The chart's operator, run here: its Deployment's arguments, authenticated with a token of
    its ServiceAccount (not the admin's kubeconfig), so RBAC judges every call it makes; through
    `proxy` when given, which records those calls."""
    kubeconfig = service_account_kubeconfig(
        cluster, ns, f"{RELEASE}-operator", tmp / "sa.yaml", proxy.url if proxy else None
    )
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    args, env = installed_operator(cluster, ns, liveness)
    operator = Operator(args, kubeconfig, tmp / "operator.log", resync_s=2, env=env)
    try:
        # kopf answers its liveness endpoint once it has started and logged in.
        wait_for("the operator to start", lambda: _live(liveness, operator))
        yield operator
    finally:
        operator.stop()
    # RBAC's refusal reads `... is forbidden: User "system:serviceaccount:..." cannot ...`.
    forbidden = [line for line in operator.log().splitlines() if 'is forbidden: User "' in line]
    assert not forbidden, "\n".join(forbidden[:3])  # a call the chart's RBAC does not allow


def owned(cluster: Api, path: str, uid: str) -> dict[str, Any] | None:
    obj = cluster.get(path)
    refs = (obj or {}).get("metadata", {}).get("ownerReferences", [])
    return obj if any(r["uid"] == uid for r in refs) else None


def child_path(kind: str, ns: str, name: str) -> str:
    from minisgl_operator.kube import path

    child = KINDS[kind]
    return path(child.api_version, child.plural, ns, name)


def conditions(cluster: Api, ns: str, name: str) -> dict[str, dict[str, Any]]:
    status = (cluster.get(ms_path(ns, name)) or {}).get("status") or {}
    return {c["type"]: c for c in status.get("conditions", [])}


EVERYTHING_ON = {
    "rbac": {"inferencePool": True},
    "operator": {"prometheusUrl": "http://prometheus.monitoring:9090"},
    "prometheusAdapter": {"rulesConfigMap": {"enabled": True}},
    "dashboards": {"enabled": True, "annotations": {"grafana_folder": "minisgl"}},
    "modelServer": {
        "enabled": True,
        "name": "qwen",
        "spec": {
            "model": "Qwen/Qwen3-0.6B",
            "engine": {"speculative": {"algorithm": "ngram", "numDraftTokens": 3}},
            "resources": {"gpus": 0},
            "autoscaling": {"maxReplicas": 3, "targets": {"ttftP95Seconds": 0.5}},
        },
    },
}


def test_helm_install_with_default_values(cluster: Api, tmp_path: Path) -> None:
    with namespace(cluster, "helm") as ns:
        objs = install(cluster, ns, {})
        kinds = sorted({o["kind"] for o in objs})
        assert kinds == [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "Deployment",
            "ServiceAccount",
        ]
        dry_run_examples(cluster, ns)
        uninstall(cluster, ns, objs)


def test_helm_install_with_everything_on(cluster: Api, tmp_path: Path) -> None:
    """Routing RBAC, one watched namespace, the prometheus-adapter rules, annotated dashboards
    and a ModelServer from values; the namespaced operator reconciles an autoscaled ModelServer
    with nothing but its Role."""
    with namespace(cluster, "helm") as ns, namespace(cluster, "watched") as watched:
        values = copy.deepcopy(EVERYTHING_ON)
        values["operator"]["watchNamespace"] = watched
        objs = install(cluster, ns, values)
        kinds = {(o["kind"], o["metadata"].get("namespace")) for o in objs}
        # The chart's ModelServer goes where its operator looks.
        assert {("Role", watched), ("RoleBinding", watched), ("ModelServer", watched)} <= kinds
        assert not {"ClusterRole", "ClusterRoleBinding"} & {k for k, _ in kinds}
        adapter = f"/api/v1/namespaces/{ns}/configmaps/{RELEASE}-prometheus-adapter-rules"
        assert "minisgl_" in (cluster.get(adapter) or {})["data"]["config.yaml"]
        dry_run_examples(cluster, ns)

        with operator_as_installed(cluster, ns, tmp_path):
            auto = {"model": "m", "resources": {"gpus": 0}, "autoscaling": {"maxReplicas": 2}}
            created = cluster.create(modelserver(watched, "auto", auto))
            assert created.status_code == 201, created.text
            uid = created.json()["metadata"]["uid"]
            for kind in ("Deployment", "Service", "HorizontalPodAutoscaler"):
                wait_for(
                    f"the {kind}",
                    lambda k=kind: owned(cluster, child_path(k, watched, "auto"), uid),
                )
            wait_for("status", lambda: "Degraded" in conditions(cluster, watched, "auto"))
            assert conditions(cluster, watched, "auto")["Degraded"]["status"] == "False"
            chart_ms = cluster.get(ms_path(watched, "qwen"))
            assert chart_ms is not None
            chart_uid = chart_ms["metadata"]["uid"]
            wait_for(
                "the chart's ModelServer's Deployment",
                lambda: owned(cluster, child_path("Deployment", watched, "qwen"), chart_uid),
            )
        uninstall(cluster, ns, objs)


# --- the operator as installed, through a ModelServer's life -------------------------------------


@pytest.fixture
def installed(cluster: Api, upstream_crds: list[str]) -> Iterator[str]:
    """The chart installed cluster-wide with routing RBAC (Helm applies the CRD), in its own
    namespace; uninstalled afterwards."""
    with namespace(cluster, "minisgl") as ns:
        objs = install(cluster, ns, {"rbac": {"inferencePool": True}})
        try:
            yield ns
        finally:
            uninstall(cluster, ns, objs)


def merge_patch(cluster: Api, path: str, patch: dict[str, Any]) -> dict[str, Any]:
    resp = cluster.client.patch(
        path, headers={"Content-Type": "application/merge-patch+json"}, json=patch
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_operator_under_its_service_account_through_a_modelservers_life(
    cluster: Api, installed: str, tmp_path: Path
) -> None:
    proxy = RecordingProxy(cluster.info)
    with (
        proxy,
        namespace(cluster, "life") as ns,
        operator_as_installed(cluster, installed, tmp_path, proxy),
    ):
        path = ms_path(ns, "qwen")
        created = cluster.create(modelserver(ns, "qwen", {"model": "m", "resources": {"gpus": 0}}))
        assert created.status_code == 201, created.text
        uid = created.json()["metadata"]["uid"]

        def child(kind: str, name: str = "qwen") -> dict[str, Any] | None:
            return owned(cluster, child_path(kind, ns, name), uid)

        def healthy() -> bool:
            ms = cluster.get(path) or {}
            status = ms.get("status") or {}
            conds = {c["type"]: c for c in status.get("conditions", [])}
            generation = ms.get("metadata", {}).get("generation")
            return (
                status.get("observedGeneration") == generation
                and conds.get("Degraded", {}).get("status") == "False"
            )

        # Create: the workload, its Service and a status that names no problem.
        deployment = wait_for("the Deployment", lambda: child("Deployment"))
        assert deployment["spec"]["replicas"] == 1
        service = wait_for("the Service", lambda: child("Service"))
        wait_for("status for the spec", healthy)
        assert not (cluster.get(path) or {})["metadata"].get("finalizers")

        # Scale, as `kubectl scale` or an autoscaler does: through /scale.
        merge_patch(cluster, f"{path}/scale", {"spec": {"replicas": 2}})
        wait_for("2 replicas", lambda: (child("Deployment") or {})["spec"]["replicas"] == 2)

        # A spec edit: a new engine flag rolls out; autoscaling adds an HPA (no KEDA here), a
        # model cache its claim and a host its Ingress.
        edit = {
            "engine": {"dtype": "float32"},
            "autoscaling": {"maxReplicas": 3},
            "modelCache": {"size": "1Gi"},
            "ingress": {"host": "qwen.example.com"},
        }
        merge_patch(cluster, path, {"spec": edit})
        wait_for("the cache claim", lambda: child("PersistentVolumeClaim", "qwen-cache"))
        wait_for("the Ingress", lambda: child("Ingress"))

        def command() -> list[str]:
            dep = child("Deployment") or {"spec": {"template": {"spec": {"containers": [{}]}}}}
            return dep["spec"]["template"]["spec"]["containers"][0].get("command", [])

        wait_for("the edit in the pods' command", lambda: "float32" in command())
        hpa = wait_for("the HPA", lambda: child("HorizontalPodAutoscaler"))
        assert hpa["spec"]["maxReplicas"] == 3
        wait_for("status for the edit", healthy)

        # Drift: a deleted Service comes back at once (watched); a deleted HPA at the next
        # resync (not watched).
        cluster.delete(child_path("Service", ns, "qwen"))
        wait_for(
            "a new Service",
            lambda: (child("Service") or service)["metadata"]["uid"] != service["metadata"]["uid"],
        )
        cluster.delete(child_path("HorizontalPodAutoscaler", ns, "qwen"))
        wait_for(
            "a new HPA",
            lambda: (
                (child("HorizontalPodAutoscaler") or hpa)["metadata"]["uid"]
                != hpa["metadata"]["uid"]
            ),
        )

        # Without the cache and the host, their claim and Ingress go.
        merge_patch(cluster, path, {"spec": {"modelCache": None, "ingress": None}})
        wait_for("the Ingress to go", lambda: child("Ingress") is None)

        # Multi-node: a LeaderWorkerSet (accepted by its upstream CRD) replaces the Deployment.
        merge_patch(cluster, path, {"spec": {"engine": {"tensorParallelSize": 2, "nodes": 2}}})
        lws = wait_for("the LeaderWorkerSet", lambda: child("LeaderWorkerSet"))
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        # The group's shared secret and the NetworkPolicy around its link.
        node_secret = ("Secret", node_security.secret_name("qwen"))
        node_policy = ("NetworkPolicy", node_security.policy_name("qwen"))
        for kind, name in (node_secret, node_policy):
            wait_for(f"the {kind}", lambda k=kind, n=name: child(k, n))
        wait_for(
            "the Deployment to go",
            lambda: cluster.get(child_path("Deployment", ns, "qwen")) is None,
        )
        wait_for("status for multi-node", healthy)

        # Routing: an InferencePool, its endpoint picker and an HTTPRoute from a Gateway.
        routing = {"inferencePool": True, "gatewayRef": {"name": "gateway"}}
        merge_patch(cluster, path, {"spec": {"routing": routing}})
        pool = wait_for("the InferencePool", lambda: child("InferencePool"))
        route = wait_for("the HTTPRoute", lambda: child("HTTPRoute"))
        assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]
        picker = [("ServiceAccount", "qwen-epp"), ("Role", "qwen-epp"), ("RoleBinding", "qwen-epp")]
        picker += [("Service", "qwen-epp"), ("Deployment", "qwen-epp")]
        for kind, name in picker:
            wait_for(f"the picker's {kind}", lambda k=kind, n=name: child(k, n))
        wait_for("status for routing", healthy)
        assert (cluster.get(path) or {})["status"][
            "routing"
        ] == f"InferencePool+Gateway {ns}/gateway"

        # Back to one plain pod: what routing, multi-node and autoscaling added goes.
        plain = {"routing": None, "autoscaling": None, "engine": {"nodes": 1}}
        merge_patch(cluster, path, {"spec": plain})
        for kind, name in (*picker, node_secret, node_policy, ("LeaderWorkerSet", "qwen")):
            wait_for(f"the {kind} {name} to go", lambda k=kind, n=name: child(k, n) is None)
        for kind in ("InferencePool", "HTTPRoute", "HorizontalPodAutoscaler"):
            wait_for(f"the {kind} to go", lambda k=kind: child(k) is None)
        wait_for("the Deployment again", lambda: child("Deployment"))
        wait_for("status for the plain spec", healthy)

        # Delete: the ModelServer goes, and everything it owned with it.
        owned_paths = [child_path(k, ns, n) for k, n in (*picker, node_secret, node_policy)]
        owned_paths += [child_path(k, ns, "qwen") for k in ("Service", "Deployment")]
        assert cluster.delete(path).status_code == 200
        wait_for("the ModelServer to go", lambda: cluster.get(path) is None)
        for p in owned_paths:
            wait_for(f"{p} to go", lambda p=p: cluster.get(p) is None)

    # RBAC: the chart grants what the operator called, and nothing else but what it needs
    # without calling it here.
    role = cluster.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{RELEASE}-operator")
    assert role is not None
    granted = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    called = proxy.attributes()
    assert called <= granted, sorted(called - granted)  # else forbidden, seen in the log
    owner = modelserver(ns, "qwen", {"model": "m", "routing": {"inferencePool": True}})
    owner["metadata"]["uid"] = "u"
    (picker_role,) = [
        c for c in plan(owner, Cluster(inference_pool=True)).apply if c["kind"] == "Role"
    ]
    uncalled_but_needed = {
        # kopf posts a core v1 Event (POST) when a handler fails: none failed here.
        ("", "events", "create"),
        # blockOwnerDeletion on the children's ownerReferences: the admission plugin
        # OwnerReferencesPermissionEnforcement (on in some clusters) asks for it.
        (GROUP, f"{PLURAL}/finalizers", "update"),
        # KEDA is not installed here: its ScaledObject replaces the HPA, with the same verbs.
        *{("keda.sh", "scaledobjects", v) for v in ("get", "create", "patch", "delete")},
        # RBAC lets the operator grant the picker's Role only what it holds itself.
        *{
            (g, r, v)
            for rule in picker_role["rules"]
            for g in rule["apiGroups"]
            for r in rule["resources"]
            for v in rule["verbs"]
        },
    }
    unused = sorted(granted - called - uncalled_but_needed)
    assert not unused, "granted, never called: " + ", ".join(map(str, unused))


def test_a_modelserver_is_deleted_while_the_operator_is_gone(
    cluster: Api, installed: str, tmp_path: Path
) -> None:
    """No finalizer: nothing blocks deleting a ModelServer after the operator is stopped or
    uninstalled (a kopf finalizer would keep it Terminating forever)."""
    with namespace(cluster, "orphan") as ns:
        path = ms_path(ns, "qwen")
        with operator_as_installed(cluster, installed, tmp_path):
            # As an operator before this version left it: with kopf's finalizer, which this
            # one removes.
            old = modelserver(ns, "qwen", {"model": "m"})
            old["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
            created = cluster.create(old)
            assert created.status_code == 201, created.text
            uid = created.json()["metadata"]["uid"]
            wait_for(
                "the finalizer to go",
                lambda: not (cluster.get(path) or {})["metadata"].get("finalizers"),
            )
            wait_for(
                "the Deployment", lambda: owned(cluster, child_path("Deployment", ns, "qwen"), uid)
            )
            wait_for("status", lambda: "Degraded" in conditions(cluster, ns, "qwen"))
        assert cluster.delete(path).status_code == 200
        wait_for("the ModelServer to go", lambda: cluster.get(path) is None, timeout=10)
        wait_for(
            "its Deployment to go",
            lambda: cluster.get(child_path("Deployment", ns, "qwen")) is None,
        )


def test_pods_a_quota_refuses_make_the_modelserver_degraded_with_the_quotas_words(
    cluster: Api, installed: str, tmp_path: Path
) -> None:
    """The controller-manager's own Deployment conditions: Progressing says only that a
    ReplicaSet was made; ReplicaFailure says why no pod is."""
    with namespace(cluster, "quota") as ns, operator_as_installed(cluster, installed, tmp_path):
        quota = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "no-pods", "namespace": ns},
            "spec": {"hard": {"pods": "0"}},
        }
        assert cluster.create(quota).status_code == 201
        created = cluster.create(modelserver(ns, "q", {"model": "m", "resources": {"gpus": 0}}))
        assert created.status_code == 201, created.text

        def degraded() -> dict[str, Any] | None:
            c = conditions(cluster, ns, "q").get("Degraded")
            return c if c and c["reason"] == "RolloutFailed" else None

        message = wait_for("RolloutFailed", degraded)["message"]
        assert "exceeded quota: no-pods" in message, message


def test_without_the_leader_worker_set_grant_the_operator_keeps_running(
    cluster: Api, upstream_crds: list[str], tmp_path: Path
) -> None:
    """rbac.leaderWorkerSet=false with the LeaderWorkerSet CRD installed: the operator must not
    watch what it may not list (kopf retries a forbidden watch, then stops the operator). It
    serves single-node ModelServers and reports a multi-node one Degraded (forbidden)."""
    with namespace(cluster, "nolws") as ns:
        objs = install(cluster, ns, {"rbac": {"leaderWorkerSet": False}})
        try:
            path = ms_path(ns, "group")
            with operator_as_installed(cluster, ns, tmp_path) as operator:
                single = cluster.create(modelserver(ns, "single", {"model": "m"}))
                assert single.status_code == 201, single.text
                uid = single.json()["metadata"]["uid"]
                wait_for(
                    "the Deployment",
                    lambda: owned(cluster, child_path("Deployment", ns, "single"), uid),
                )
                multi = {"model": "m", "engine": {"tensorParallelSize": 2, "nodes": 2}}
                assert cluster.create(modelserver(ns, "group", multi)).status_code == 201
                wait_for("status", lambda: "Degraded" in conditions(cluster, ns, "group"))
                degraded = conditions(cluster, ns, "group")["Degraded"]
                assert degraded["status"] == "True" and degraded["reason"] == "ApplyFailed"
                assert "forbidden" in degraded["message"]
                assert operator.proc.poll() is None
                assert cluster.delete(path).status_code == 200
        finally:
            uninstall(cluster, ns, objs)


@pytest.mark.parametrize(
    "example,kind",
    [
        ("modelserver-multinode.yaml", "LeaderWorkerSet"),
        ("modelserver-routed.yaml", "InferencePool"),
        ("modelserver-routed.yaml", "HTTPRoute"),
    ],
)
def test_the_upstream_crds_accept_what_the_operator_renders_for_the_examples(
    cluster: Api, upstream_crds: list[str], example: str, kind: str
) -> None:
    """A server-side dry run with strict field validation: the upstream CRD (schema, defaults,
    CEL) judges the object the operator would make for the example; nothing is created."""
    owner = yaml.safe_load((ROOT / "examples" / example).read_text())
    owner["metadata"].update(namespace="default", uid="00000000-0000-0000-0000-000000000001")
    cluster_kinds = Cluster(leader_worker_set=True, inference_pool=True, gateway_api=True)
    (obj,) = [c for c in plan(owner, cluster_kinds).apply if c["kind"] == kind]
    obj["metadata"].pop("ownerReferences")  # the owner does not exist in a dry run
    resp = cluster.create(obj, dry_run=True)
    assert resp.status_code == 201, resp.text
