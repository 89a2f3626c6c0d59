"""A real Kubernetes API server for the tests: the cluster KUBECONFIG names.

`scripts/test.sh` (README "Test", CI) starts a throwaway control plane (etcd, kube-apiserver,
kube-controller-manager; no kubelet, so pods stay Pending) and exports its KUBECONFIG. The
upstream CRDs the operator's optional children are checked against (LeaderWorkerSet, Gateway
API, InferencePool) come from $MINISGL_K8S_CRDS, which it exports too.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import kopf
import yaml
from k8s_support import CRD_PATH, ROOT

from minisgl.testing.live_server import stop_process

CONNECT_TIMEOUT_S = 3.0
WAIT_S = 60.0
FIELD_MANAGER = "minisgl-tests"
# Next to the control plane the tests run against (scripts/test.sh exports the location).
UPSTREAM_CRDS = Path(os.environ.get("MINISGL_K8S_CRDS") or ROOT.parent / "shared/k8s/crds")


class Api:
    """Blocking calls to one API server with one set of credentials."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.info = info
        self.client = httpx.Client(
            base_url=info.server,
            headers=info.as_http_headers(),
            verify=info.as_ssl_context(),
            timeout=httpx.Timeout(30.0, connect=CONNECT_TIMEOUT_S),
        )
        self._plurals: dict[tuple[str, str], tuple[str, bool]] = {}

    def close(self) -> None:
        self.client.close()

    def get(self, path: str) -> dict[str, Any] | None:
        resp = self.client.get(path)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return resp.json()

    def apply(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply (what the operator and Helm do)."""
        resp = self.client.patch(
            path,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            headers={"Content-Type": "application/apply-patch+yaml"},
            content=json.dumps(obj),  # JSON is YAML, and much faster to write
        )
        assert resp.status_code < 300, resp.text
        return resp.json()

    def create(self, obj: dict[str, Any], dry_run: bool = False) -> httpx.Response:
        """POST to the object's collection; strict field validation, like `kubectl create`."""
        params = {"fieldValidation": "Strict", **({"dryRun": "All"} if dry_run else {})}
        return self.client.post(self.collection(obj), params=params, json=obj)

    def delete(self, path: str) -> httpx.Response:
        return self.client.delete(path)

    def resource(self, api_version: str, kind: str) -> tuple[str, bool]:
        """(plural, namespaced) of a kind, from discovery."""
        key = (api_version, kind)
        if key not in self._plurals:
            root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            resources = (self.get(root) or {}).get("resources", [])
            for r in resources:
                if "/" not in r["name"]:
                    self._plurals[(api_version, r["kind"])] = (r["name"], r["namespaced"])
        return self._plurals[key]

    def collection(self, obj: dict[str, Any]) -> str:
        plural, namespaced = self.resource(obj["apiVersion"], obj["kind"])
        root = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
        ns = obj["metadata"].get("namespace")
        return f"{root}/namespaces/{ns}/{plural}" if namespaced else f"{root}/{plural}"

    def path(self, obj: dict[str, Any]) -> str:
        return f"{self.collection(obj)}/{obj['metadata']['name']}"


def wait_for(what: str, check: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.25)


def connect() -> tuple[Api | None, str]:
    """The cluster KUBECONFIG names, or why there is none."""
    kubeconfig = os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
    if not all(Path(p).exists() for p in kubeconfig.split(os.pathsep) if p):
        return None, f"no Kubernetes cluster: kubeconfig {kubeconfig} does not exist"
    api = None
    try:
        info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
        assert info is not None, "the kubeconfig has no current context"
        api = Api(info)
        api.client.get("/version", timeout=CONNECT_TIMEOUT_S).raise_for_status()
    except Exception as e:  # any failure to reach a cluster means: nothing to test against
        if api is not None:
            api.close()
        return None, f"no Kubernetes cluster answers at {kubeconfig}'s server: {e}"
    return api, ""


CRD_ROOT = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def established(api: Api, name: str) -> bool:
    conditions = ((api.get(f"{CRD_ROOT}/{name}") or {}).get("status") or {}).get("conditions")
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions or [])


def apply_crd(api: Api, crd: dict[str, Any]) -> None:
    name = crd["metadata"]["name"]
    api.apply(f"{CRD_ROOT}/{name}", crd)
    wait_for(f"CRD {name} to be established", lambda: established(api, name))


def install_modelserver_crd(api: Api) -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    apply_crd(api, crd)
    return crd


def load_yaml(path: Path) -> Any:
    # libyaml's loader: the LeaderWorkerSet CRD (1.3 MB) takes seconds in pure Python.
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def install_upstream_crds(api: Api) -> list[str]:
    """Created, not applied (an apply of the 1.3 MB LeaderWorkerSet CRD takes seconds more),
    all before waiting for any: the API server establishes them side by side."""
    names = []
    for path in sorted(UPSTREAM_CRDS.glob("*.yaml")):
        crd = load_yaml(path)
        resp = api.client.post(CRD_ROOT, json=crd)
        assert resp.status_code in (201, 409), resp.text  # 409: there from an earlier session
        names.append(crd["metadata"]["name"])
    for name in names:
        wait_for(f"CRD {name} to be established", lambda n=name: established(api, n))
    return names


@contextmanager
def namespace(api: Api, prefix: str) -> Iterator[str]:
    """A fresh namespace, deleted afterwards (the namespace controller empties it)."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    api.apply(
        f"/api/v1/namespaces/{name}",
        {"apiVersion": "v1", "kind": "Namespace"} | {"metadata": {"name": name}},
    )
    try:
        yield name
    finally:
        api.delete(f"/api/v1/namespaces/{name}")


def service_account_kubeconfig(api: Api, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount, with a token from the TokenRequest
    API (what the kubelet mounts into its pods): exactly the rights its Roles grant."""
    resp = api.client.post(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        json={
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600},
        },
    )
    assert resp.status_code == 201, resp.text
    token = resp.json()["status"]["token"]
    info = api.info
    cluster: dict[str, Any] = {"server": info.server}
    if info.ca_data:
        cluster["certificate-authority-data"] = base64.b64encode(info.ca_data).decode()
    elif info.ca_path:
        cluster["certificate-authority"] = info.ca_path
    if info.insecure:
        cluster["insecure-skip-tls-verify"] = True
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": cluster}],
                "users": [{"name": account, "user": {"token": token}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": account}}],
                "current-context": "test",
            }
        )
    )
    return path


class Operator:
    """`python -m minisgl_operator ARGS` as a subprocess, logged to a file."""

    def __init__(
        self,
        args: list[str],
        kubeconfig: Path,
        log: Path,
        resync_s: float,
        env: dict[str, str] | None = None,
    ) -> None:
        env = {
            **os.environ,
            **(env or {}),
            "KUBECONFIG": str(kubeconfig),
            "MINISGL_OPERATOR_RESYNC_SECONDS": str(resync_s),
        }
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minisgl_operator", *args],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        code = stop_process(self.proc, timeout_s=15)
        self._log.close()
        return code
