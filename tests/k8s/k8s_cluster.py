"""A real Kubernetes API server for the tests: the cluster KUBECONFIG names.

`scripts/test.sh` (README "Test", CI) starts a throwaway control plane (etcd, kube-apiserver,
kube-controller-manager; no kubelet, so pods stay Pending) and exports its KUBECONFIG. The
upstream CRDs the operator's optional children are checked against (LeaderWorkerSet, Gateway
API, InferencePool) come from $MINISGL_K8S_CRDS, which it exports too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
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


def service_account_kubeconfig(
    api: Api, namespace: str, account: str, path: Path, server: str | None = None
) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount, with a token from the TokenRequest
    API (what the kubelet mounts into its pods): exactly the rights its Roles grant. `server`:
    another address of the API server (a RecordingProxy's)."""
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
    if server is not None:
        cluster = {"server": server}
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


# --- what a client calls: a recording proxy in front of the API server ----------------------

# Paths that name no resource (discovery, version): any authenticated user may read them.
_NON_RESOURCE_PREFIXES = ("/version", "/openapi", "/healthz", "/livez", "/readyz")


def rbac_attributes(method: str, path: str, query: str, status: int) -> list[tuple[str, str, str]]:
    """The (apiGroup, resource[/subresource], verb) an API request is authorized as, as the
    API server's RequestInfo resolves it; [] for non-resource paths. A server-side apply that
    creates its object (201) needs create as well as patch."""
    parts = [p for p in path.split("/") if p]
    if path.startswith(_NON_RESOURCE_PREFIXES) or not parts:
        return []
    if parts[0] == "api" and len(parts) >= 2:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return []  # /api, /apis, /apis/<group>: discovery
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) != 2:
        rest = rest[2:]  # namespaced: /namespaces/<ns>/<resource>...
    if not rest:
        return []  # /apis/<group>/<version>: discovery
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource += "/" + rest[2]
    params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
    if method == "GET":
        watch = params.get("watch") in ("true", "1")
        verb = "get" if name else ("watch" if watch else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]
        if verb == "delete" and not name:
            verb = "deletecollection"
    out = [(group, resource, verb)]
    if method == "PATCH" and status == 201:
        out.append((group, resource, "create"))
    return out


class RecordingProxy:
    """Plain HTTP on 127.0.0.1 to the API server's HTTPS, passing every request through as is
    (watches streamed) and recording its method, path, query and status. A client pointed here
    makes exactly the calls it would make directly, with its own credentials."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.upstream = info.server.rstrip("/")
        self.ssl = info.as_ssl_context()
        self.calls: list[tuple[str, str, str, int]] = []
        self.port = 0
        self._loop: Any = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        assert self._ready.wait(30), "the recording proxy did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        passed = ("Authorization", "Content-Type", "Accept")

        async def forward(request: web.Request) -> web.StreamResponse:
            headers = {k: v for k, v in request.headers.items() if k in passed}
            body = await request.read()
            async with session.request(
                request.method,
                self.upstream + request.path_qs,
                headers=headers,
                data=body or None,
                ssl=self.ssl,
            ) as upstream:
                self.calls.append(
                    (request.method, request.path, request.query_string, upstream.status)
                )
                out = web.StreamResponse(status=upstream.status)
                if "Content-Type" in upstream.headers:
                    out.content_type = upstream.headers["Content-Type"].split(";")[0]
                await out.prepare(request)
                with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
                    async for chunk in upstream.content.iter_any():
                        await out.write(chunk)
                return out

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await session.close()

    def attributes(self) -> set[tuple[str, str, str]]:
        return {a for m, p, q, s in self.calls for a in rbac_attributes(m, p, q, s)}
