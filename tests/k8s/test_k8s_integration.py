"""The real operator (kopf.testing.KopfRunner) against the cluster KUBECONFIG names.

Skipped, with the reason, when no cluster answers within a few seconds. Pods need not become
ready (the server image may be absent): this checks what the operator makes and keeps.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest
import yaml
from k8s_support import CRD_PATH
from kopf.testing import KopfRunner

pytestmark = pytest.mark.k8s

CONNECT_TIMEOUT_S = 3.0
WAIT_S = 90.0


def _cluster() -> tuple[httpx.Client | None, str]:
    kubeconfig = os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
    if not all(Path(p).exists() for p in kubeconfig.split(os.pathsep) if p):
        return None, f"no Kubernetes cluster: kubeconfig {kubeconfig} does not exist"
    try:
        info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
        assert info is not None
        client = httpx.Client(
            base_url=info.server,
            headers=info.as_http_headers(),
            verify=info.as_ssl_context(),
            timeout=httpx.Timeout(30.0, connect=CONNECT_TIMEOUT_S),
        )
        client.get("/version", timeout=CONNECT_TIMEOUT_S).raise_for_status()
    except Exception as e:  # any failure to reach a cluster means: nothing to test against
        return None, f"no Kubernetes cluster answers at the kubeconfig's server: {e}"
    return client, ""


@pytest.fixture(scope="module")
def api() -> Iterator[httpx.Client]:
    client, reason = _cluster()
    if client is None:
        pytest.skip(reason)
    with client:
        yield client


def wait_for(what: str, check: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def get(api: httpx.Client, path: str) -> dict[str, Any] | None:
    r = api.get(path)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


def apply(api: httpx.Client, path: str, obj: dict[str, Any]) -> None:
    r = api.patch(
        path,
        params={"fieldManager": "minisgl-tests", "force": "true"},
        headers={"Content-Type": "application/apply-patch+yaml"},
        content=yaml.safe_dump(obj),
    )
    assert r.status_code < 300, r.text


def gone(api: httpx.Client, path: str) -> Callable[[], bool]:
    return lambda: get(api, path) is None


def test_operator_end_to_end(api: httpx.Client) -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    crd_path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
    apply(api, crd_path, crd)
    wait_for(
        "the CRD to be established",
        lambda: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in ((get(api, crd_path) or {}).get("status") or {}).get("conditions", [])
        ),
    )
    ns = f"minisgl-it-{uuid.uuid4().hex[:6]}"
    apply(
        api,
        f"/api/v1/namespaces/{ns}",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
    )
    ms_path = f"/apis/minisgl.io/v1alpha1/namespaces/{ns}/modelservers/qwen"
    dep_path = f"/apis/apps/v1/namespaces/{ns}/deployments/qwen"
    svc_path = f"/api/v1/namespaces/{ns}/services/qwen"
    hpa_path = f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/qwen"
    so_path = f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/qwen"
    ms: dict[str, Any] = {
        "apiVersion": "minisgl.io/v1alpha1",
        "kind": "ModelServer",
        "metadata": {"name": "qwen", "namespace": ns},
        "spec": {
            "model": "Qwen/Qwen3-0.6B",
            "resources": {"gpus": 0},
            "autoscaling": {"maxReplicas": 2, "prometheusUrl": "http://prometheus:9090"},
        },
    }
    args = ["run", "--standalone", "--namespace", ns, "-m", "minisgl_operator.handlers"]
    try:
        with KopfRunner(args, timeout=60) as runner:
            apply(api, ms_path, ms)
            owner = wait_for("the ModelServer", lambda: get(api, ms_path))
            uid = owner["metadata"]["uid"]

            def owned(path: str) -> dict[str, Any] | None:
                obj = get(api, path)
                refs = (obj or {}).get("metadata", {}).get("ownerReferences", [])
                return obj if any(r["uid"] == uid for r in refs) else None

            dep = wait_for("the Deployment", lambda: owned(dep_path))
            svc = wait_for("the Service", lambda: owned(svc_path))
            wait_for("the autoscaler", lambda: owned(hpa_path) or owned(so_path))
            wait_for(
                "status conditions",
                lambda: (
                    {
                        c["type"]
                        for c in (get(api, ms_path) or {}).get("status", {}).get("conditions", [])
                    }
                    >= {"Ready", "Progressing", "Degraded"}
                ),
            )

            # A spec edit rolls out.
            edited = {**ms, "spec": {**ms["spec"], "engine": {"dtype": "float32"}}}
            apply(api, ms_path, edited)
            wait_for(
                "the edit to reach the Deployment",
                lambda: (
                    "float32"
                    in (get(api, dep_path) or dep)["spec"]["template"]["spec"]["containers"][0][
                        "command"
                    ]
                ),
            )

            # A hand-deleted child comes back.
            api.delete(svc_path).raise_for_status()
            wait_for(
                "the Service to be recreated",
                lambda: (owned(svc_path) or svc)["metadata"]["uid"] != svc["metadata"]["uid"],
            )

            # Deleting the ModelServer leaves nothing behind.
            api.delete(ms_path).raise_for_status()
            wait_for("the ModelServer to go", lambda: get(api, ms_path) is None)
            for path in (dep_path, svc_path, hpa_path):
                wait_for(f"{path} to go", gone(api, path))
        assert runner.exception is None
    finally:
        api.delete(f"/api/v1/namespaces/{ns}")


def _served(api: httpx.Client, api_version: str, plural: str) -> bool:
    resp = api.get(f"/apis/{api_version}")
    return resp.status_code == 200 and any(
        r.get("name") == plural for r in resp.json().get("resources", [])
    )


@pytest.mark.parametrize(
    "example,kind,plural",
    [
        ("modelserver-multinode.yaml", "LeaderWorkerSet", "leaderworkersets"),
        ("modelserver-routed.yaml", "InferencePool", "inferencepools"),
        ("modelserver-routed.yaml", "HTTPRoute", "httproutes"),
    ],
)
def test_the_real_crds_accept_what_the_operator_renders(
    api: httpx.Client, example: str, kind: str, plural: str
) -> None:
    """A server-side dry run with strict field validation: the cluster's own CRD (schema,
    defaults, CEL) judges the object; nothing is created."""
    from minisgl_operator.children import KINDS, Cluster, plan

    child = KINDS[kind]
    if not _served(api, child.api_version, plural):
        pytest.skip(f"the cluster does not serve {child.api_version} {plural}")
    owner = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / example).read_text())
    owner["metadata"].update(namespace="default", uid=str(uuid.uuid4()))
    cluster = Cluster(leader_worker_set=True, inference_pool=True, gateway_api=True)
    (obj,) = [c for c in plan(owner, cluster).apply if c["kind"] == kind]
    obj["metadata"].pop("ownerReferences")  # the owner does not exist in a dry run
    resp = api.post(
        f"/apis/{child.api_version}/namespaces/default/{plural}",
        params={"dryRun": "All", "fieldValidation": "Strict"},
        json=obj,
    )
    assert resp.status_code in (200, 201), resp.text
