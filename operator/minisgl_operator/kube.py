"""A small async Kubernetes API client over httpx: just the calls the operator makes.

kopf authenticates (service account or kubeconfig) and hands over a `kopf.ConnectionInfo`;
this client reuses those credentials. Children are written with server-side apply, so a
re-apply of the same object is a no-op and fields set by others (e.g. defaults) are left alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

import httpx

from minisgl_operator import FIELD_MANAGER, GROUP, PLURAL, VERSION
from minisgl_operator.children import KINDS, ChildKind

REQUEST_TIMEOUT_S = 30.0


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Kube(Protocol):
    async def get(self, kind: ChildKind, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...

    async def delete(self, kind: ChildKind, namespace: str, name: str) -> None: ...

    async def get_modelserver(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None: ...

    async def has_api(self, api_version: str, plural: str) -> bool: ...


def path(api_version: str, plural: str, namespace: str, name: str | None = None) -> str:
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    out = f"{root}/namespaces/{namespace}/{plural}"
    return f"{out}/{name}" if name else out


def modelserver_kind() -> ChildKind:
    return ChildKind(f"{GROUP}/{VERSION}", "ModelServer", PLURAL)


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("message") or resp.text)
    except (ValueError, AttributeError):
        return resp.text


class HttpKube:
    """`Kube` over a real API server."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    @classmethod
    def from_connection(cls, info: Any) -> HttpKube:
        """From a kopf.ConnectionInfo (duck-typed so that tests need no kopf login)."""
        client = httpx.AsyncClient(
            base_url=info.server,
            headers=info.as_http_headers(),
            verify=info.as_ssl_context(),
            timeout=REQUEST_TIMEOUT_S,
            trust_env=bool(getattr(info, "trust_env", False)),
            proxy=getattr(info, "proxy_url", None),
        )
        return cls(client)

    async def _send(self, method: str, url: str, **kw: Any) -> httpx.Response:
        resp = await self.client.request(method, url, **kw)
        if resp.status_code >= 400 and resp.status_code != 404:
            raise KubeError(resp.status_code, _message(resp))
        return resp

    async def get(self, kind: ChildKind, namespace: str, name: str) -> dict[str, Any] | None:
        resp = await self._send("GET", path(kind.api_version, kind.plural, namespace, name))
        return None if resp.status_code == 404 else resp.json()

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        kind = KINDS[obj["kind"]]
        meta = obj["metadata"]
        resp = await self._send(
            "PATCH",
            path(kind.api_version, kind.plural, meta["namespace"], meta["name"]),
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            headers={"Content-Type": "application/apply-patch+yaml"},
            content=json.dumps(obj),  # JSON is YAML
        )
        if resp.status_code == 404:
            raise KubeError(404, _message(resp))
        return resp.json()

    async def delete(self, kind: ChildKind, namespace: str, name: str) -> None:
        # Background: the garbage collector removes the ReplicaSets and pods after.
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        await self._send("DELETE", path(kind.api_version, kind.plural, namespace, name), json=body)

    async def get_modelserver(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.get(modelserver_kind(), namespace, name)

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        url = path(f"{GROUP}/{VERSION}", PLURAL, namespace, name) + "/status"
        await self._send(
            "PATCH",
            url,
            headers={"Content-Type": "application/merge-patch+json"},
            content=json.dumps({"status": status}),
        )

    async def has_api(self, api_version: str, plural: str) -> bool:
        """Discovery: is this resource served? (e.g. KEDA's scaledobjects)."""
        resp = await self._send("GET", f"/apis/{api_version}")
        if resp.status_code == 404:
            return False
        return any(r.get("name") == plural for r in resp.json().get("resources", []))

    async def aclose(self) -> None:
        await self.client.aclose()
