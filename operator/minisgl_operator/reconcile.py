"""One reconcile pass: read, plan, apply, prune, write status. IO goes through `Kube`, so this
runs against a real API server in the operator and an in-memory fake in unit tests.

Nothing here raises for a bad spec or a refused write: each becomes a Degraded condition, and
the next pass (timer or event) tries again.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minisgl_operator.children import (
    CLAIM,
    DEPLOYMENT,
    HTTP_ROUTE,
    INFERENCE_POOL,
    KINDS,
    LEADER_WORKER_SET,
    OPT_IN_KINDS,
    SCALED_OBJECT,
    SECRET,
    ChildKind,
    Cluster,
    Problem,
    plan,
    workload_kind,
)
from minisgl_operator.kube import Kube, KubeError
from minisgl_operator.meta import cache_claim_name
from minisgl_operator.node_security import secret_name
from minisgl_operator.routing import PickerConfig
from minisgl_operator.spec import SpecError, parse_spec
from minisgl_operator.status import compute_status


@dataclass(frozen=True)
class Config:
    """The operator's own settings (from its command line)."""

    prometheus_url: str | None = None
    picker: PickerConfig = PickerConfig()


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


async def _cluster(kube: Kube, config: Config) -> Cluster:
    async def served(kind: ChildKind) -> bool:
        return await kube.has_api(kind.api_version, kind.plural)

    return Cluster(
        keda=await served(SCALED_OBJECT),
        prometheus_url=config.prometheus_url,
        leader_worker_set=await served(LEADER_WORKER_SET),
        inference_pool=await served(INFERENCE_POOL),
        gateway_api=await served(HTTP_ROUTE),
        picker=config.picker,
    )


async def _get_optional(kube: Kube, kind: ChildKind, ns: str, name: str) -> dict[str, Any] | None:
    """A child that may exist; kinds the chart grants only on request (rbac.leaderWorkerSet,
    rbac.inferencePool) read as absent when forbidden: without the grant we made none."""
    try:
        return await kube.get(kind, ns, name)
    except KubeError as e:
        if e.status == 403 and kind in OPT_IN_KINDS:
            return None
        raise


def _wanted_kind(owner: Mapping[str, Any]) -> ChildKind:
    """The workload kind the spec asks for; a Deployment when the spec cannot be read."""
    meta = owner["metadata"]
    try:
        return workload_kind(parse_spec(meta["name"], meta["namespace"], owner.get("spec")))
    except SpecError:
        return DEPLOYMENT


async def reconcile(owner: Mapping[str, Any], kube: Kube, config: Config) -> dict[str, Any]:
    """Bring one ModelServer's children in line with its spec; return the status written."""
    meta = owner["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    problems: list[Problem] = []
    workloads: dict[str, dict[str, Any] | None] = {}
    try:
        cluster = await _cluster(kube, config)
        for kind in (DEPLOYMENT, LEADER_WORKER_SET):
            current = await _get_optional(kube, kind, ns, name) if cluster.serves(kind) else None
            # An object of ours by name only is someone else's: it must never count as ours
            # (no Ready, replicas or endpoint from it). Applying it is refused: NameConflict.
            workloads[kind.kind] = current if current and owned_by(current, uid) else None
        claim = await kube.get(CLAIM, ns, cache_claim_name(name))
        claim = claim if claim and owned_by(claim, uid) else None
        secret = await _get_optional(kube, SECRET, ns, secret_name(name))
        secret = secret if secret and owned_by(secret, uid) else None
    except KubeError as e:
        problems.append(Problem("ApiError", f"reading children: {e}"))
        status = compute_status(owner, None, None, problems, now_iso())
        await _write_status(kube, ns, name, status)
        return status
    wanted = _wanted_kind(owner)
    other = LEADER_WORKER_SET if wanted is DEPLOYMENT else DEPLOYMENT
    current_workload = workloads[wanted.kind]
    # While the workload changes kind (engine.nodes 1 <-> >1), or cannot, what still runs
    # is what serves: status reports it.
    serving = current_workload or workloads[other.kind]
    try:
        p = plan(owner, cluster, current_workload, claim, secret)
    except SpecError as e:
        problems.append(Problem("InvalidSpec", str(e)))
        status = compute_status(owner, None, serving, problems, now_iso())
        await _write_status(kube, ns, name, status)
        return status

    problems += p.problems
    for obj in p.apply:
        kind, cname = obj["kind"], obj["metadata"]["name"]
        try:
            current = await kube.get(KINDS[kind], ns, cname)
            if current is not None and not owned_by(current, uid):
                # Never take over an object someone else made under the same name.
                problems.append(Problem("NameConflict", f"{kind} {cname} exists and is not ours"))
                continue
            applied = await kube.apply(obj)
        except KubeError as e:
            problems.append(Problem("ApplyFailed", f"{kind} {cname}: {e}"))
            continue
        if kind == wanted.kind and cname == name:
            serving = applied
    for kind_, cname in p.delete:
        try:
            current = await _get_optional(kube, kind_, ns, cname)
            if current is not None and owned_by(current, uid):
                await kube.delete(kind_, ns, cname)
        except KubeError as e:
            problems.append(Problem("DeleteFailed", f"{kind_.kind} {cname}: {e}"))
    status = compute_status(owner, p.spec, serving, problems, now_iso(), p.scale_down_held)
    await _write_status(kube, ns, name, status)
    return status


async def _write_status(kube: Kube, ns: str, name: str, status: Mapping[str, Any]) -> None:
    try:
        await kube.patch_status(ns, name, status)
    except KubeError as e:
        if e.status != 404:  # the ModelServer went away meanwhile: nothing to report on
            raise
