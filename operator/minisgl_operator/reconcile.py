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
    KINDS,
    SCALED_OBJECT,
    Cluster,
    Problem,
    plan,
)
from minisgl_operator.kube import Kube, KubeError
from minisgl_operator.meta import cache_claim_name
from minisgl_operator.spec import SpecError
from minisgl_operator.status import compute_status


@dataclass(frozen=True)
class Config:
    """The operator's own settings (from its command line)."""

    prometheus_url: str | None = None


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


async def reconcile(owner: Mapping[str, Any], kube: Kube, config: Config) -> dict[str, Any]:
    """Bring one ModelServer's children in line with its spec; return the status written."""
    meta = owner["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    problems: list[Problem] = []
    try:
        deployment = await kube.get(DEPLOYMENT, ns, name)
        claim = await kube.get(CLAIM, ns, cache_claim_name(name))
        keda = await kube.has_api(SCALED_OBJECT.api_version, SCALED_OBJECT.plural)
        # An object of ours by name only is someone else's: it must never count as ours (no
        # Ready, replicas or endpoint from it). Applying it is refused below: NameConflict.
        deployment = deployment if deployment and owned_by(deployment, uid) else None
        claim = claim if claim and owned_by(claim, uid) else None
    except KubeError as e:
        problems.append(Problem("ApiError", f"reading children: {e}"))
        status = compute_status(owner, None, None, problems, now_iso())
        await _write_status(kube, ns, name, status)
        return status
    try:
        p = plan(owner, Cluster(keda=keda, prometheus_url=config.prometheus_url), deployment, claim)
    except SpecError as e:
        problems.append(Problem("InvalidSpec", str(e)))
        status = compute_status(owner, None, deployment, problems, now_iso())
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
        if kind == DEPLOYMENT.kind:
            deployment = applied
    for kind_, cname in p.delete:
        try:
            current = await kube.get(kind_, ns, cname)
            if current is not None and owned_by(current, uid):
                await kube.delete(kind_, ns, cname)
        except KubeError as e:
            problems.append(Problem("DeleteFailed", f"{kind_.kind} {cname}: {e}"))
    status = compute_status(owner, p.spec, deployment, problems, now_iso(), p.scale_down_held)
    await _write_status(kube, ns, name, status)
    return status


async def _write_status(kube: Kube, ns: str, name: str, status: Mapping[str, Any]) -> None:
    try:
        await kube.patch_status(ns, name, status)
    except KubeError as e:
        if e.status != 404:  # the ModelServer went away meanwhile: nothing to report on
            raise
