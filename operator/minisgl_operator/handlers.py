"""kopf handlers: thin adapters from kopf events to `reconcile` and the periodic resync.

Run with `python -m minisgl_operator`, or `kopf run -m minisgl_operator.handlers`.

No handler here makes kopf put a finalizer on a ModelServer (no deletion handlers, timers or
daemons: a kopf timer adds one to every object it runs on). Children go with their owner through
ownerReferences, so there is nothing to clean up, and a ModelServer deleted while the operator
is stopped or uninstalled is gone at once instead of hanging on a finalizer nobody removes.
kopf also removes its finalizer from ModelServers that an older operator left one on.
"""

from __future__ import annotations

import asyncio
import contextlib
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
# The one namespace watched (`--namespace`), or None for all.
WATCH_NAMESPACE: str | None = None
RESYNC_SECONDS = float(os.environ.get("MINISGL_OPERATOR_RESYNC_SECONDS", "30"))
_kube: HttpKube | None = None
OURS = {MANAGED_BY_LABEL: FIELD_MANAGER}
# The ModelServers the watch has shown, by (namespace, name): what the resync loop visits.
_known: set[tuple[str, str]] = set()
_resync_task: asyncio.Task[None] | None = None


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
    # Watching one namespace, the operator holds a Role there and nothing cluster-wide: kopf's
    # scans of namespaces and CRDs would be forbidden, retried for about a minute before it
    # serves. It resolves its resources once, at start, through discovery instead.
    settings.scanning.disabled = WATCH_NAMESPACE is not None


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    global _kube
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        _kube = HttpKube.from_connection(info)
    return info


@kopf.on.startup()
async def start_resync(**_: Any) -> None:
    global _resync_task
    _resync_task = asyncio.create_task(_resync_forever())


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if _resync_task is not None:
        _resync_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await _resync_task
    if _kube is not None:
        await _kube.aclose()


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def on_change(body: kopf.Body, **_: Any) -> None:
    await reconcile(body, kube(), CONFIG)


@kopf.on.event(GROUP, VERSION, PLURAL)
def remember(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    if event.get("type") == "DELETED":
        _known.discard(key)
    else:
        _known.add(key)


async def _resync_forever() -> None:
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        if _kube is None:
            continue
        for namespace, name in sorted(_known):
            try:
                owner = await _kube.get_modelserver(namespace, name)
                if owner is not None and not owner["metadata"].get("deletionTimestamp"):
                    await resync(owner)
            except Exception:  # one ModelServer's failure must not stop the others' resync
                log.exception("resync of ModelServer %s/%s failed", namespace, name)


async def resync(body: Any) -> None:
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


async def on_leader_worker_set(body: kopf.Body, **_: Any) -> None:
    # As for Deployments: a group becoming ready refreshes status (watched only while the
    # LeaderWorkerSet CRD is installed).
    meta = body["metadata"]
    await _owner_changed(meta["namespace"], meta.get("labels"))


# The watch needs list and watch on LeaderWorkerSets, which the chart grants only with
# rbac.leaderWorkerSet: kopf stops the whole operator when a watch stays forbidden (about a
# minute after start, once the CRD is installed). Without the grant the chart sets this to 0;
# multi-node ModelServers are then Degraded (forbidden) and nothing else changes.
WATCH_LEADER_WORKER_SETS = os.environ.get("MINISGL_OPERATOR_WATCH_LEADER_WORKER_SETS", "1") != "0"
if WATCH_LEADER_WORKER_SETS:
    kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=OURS)(
        on_leader_worker_set
    )


@kopf.on.event("", "v1", "services", labels=OURS)
async def on_service(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    if event.get("type") == "DELETED":
        meta = body["metadata"]
        await _owner_changed(meta["namespace"], meta.get("labels"))
