"""kopf handlers: thin adapters from kopf events to `reconcile` and the status timer.

Run with `python -m minisgl_operator`, or `kopf run -m minisgl_operator.handlers`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import httpx
import kopf

from minisgl_operator import (
    FIELD_MANAGER,
    GROUP,
    MANAGED_BY_LABEL,
    MODELSERVER_LABEL,
    PLURAL,
    VERSION,
    prometheus,
)
from minisgl_operator.kube import HttpKube, KubeError
from minisgl_operator.reconcile import Config, now_iso, reconcile
from minisgl_operator.spec import SpecError, parse_spec

log = logging.getLogger("minisgl_operator")

# Filled by __main__ (or the environment, for `kopf run -m`) before the operator starts.
CONFIG = Config(prometheus_url=os.environ.get("MINISGL_OPERATOR_PROMETHEUS_URL") or None)
RESYNC_SECONDS = float(os.environ.get("MINISGL_OPERATOR_RESYNC_SECONDS", "30"))
_kube: HttpKube | None = None
OURS = {MANAGED_BY_LABEL: FIELD_MANAGER}


def kube() -> HttpKube:
    if _kube is None:
        raise kopf.TemporaryError("not logged in yet", delay=5)
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping in our own annotations; status belongs to the ModelServer.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    global _kube
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        _kube = HttpKube.from_connection(info)
    return info


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if _kube is not None:
        await _kube.aclose()


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def on_change(body: kopf.Body, **_: Any) -> None:
    await reconcile(body, kube(), CONFIG)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, sharp=False)
async def resync(body: kopf.Body, **_: Any) -> None:
    """Heals drift the watches miss (e.g. a deleted Ingress) and refreshes observed SLOs."""
    await reconcile(body, kube(), CONFIG)
    url = CONFIG.prometheus_url
    if url is None:
        return
    meta = body["metadata"]
    try:
        spec = parse_spec(meta["name"], meta["namespace"], body.get("spec"))
        async with httpx.AsyncClient() as client:
            observed = await prometheus.observe(client, url, spec)
    except SpecError:
        return
    except httpx.HTTPError as e:
        log.warning("prometheus query failed for %s/%s: %s", meta["namespace"], meta["name"], e)
        return
    observed["time"] = now_iso()
    await kube().patch_status(meta["namespace"], meta["name"], {"observed": observed})


async def _owner_changed(namespace: str, labels: Any) -> None:
    name = (labels or {}).get(MODELSERVER_LABEL)
    if not name:
        return
    try:
        owner = await kube().get_modelserver(namespace, name)
    except KubeError as e:
        log.warning("cannot read ModelServer %s/%s: %s", namespace, name, e)
        return
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return  # the owner is going away; the garbage collector takes the children
    await reconcile(owner, kube(), CONFIG)


@kopf.on.event("apps", "v1", "deployments", labels=OURS)
async def on_deployment(body: kopf.Body, **_: Any) -> None:
    # Every rollout step (a pod became ready, ...) refreshes the owner's status; a deleted
    # Deployment is recreated at once.
    meta = body["metadata"]
    await _owner_changed(meta["namespace"], meta.get("labels"))


@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=OURS)
async def on_leader_worker_set(body: kopf.Body, **_: Any) -> None:
    # As for Deployments: a group becoming ready refreshes status (watched only while the
    # LeaderWorkerSet CRD is installed).
    meta = body["metadata"]
    await _owner_changed(meta["namespace"], meta.get("labels"))


@kopf.on.event("", "v1", "services", labels=OURS)
async def on_service(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    if event.get("type") == "DELETED":
        meta = body["metadata"]
        await _owner_changed(meta["namespace"], meta.get("labels"))
