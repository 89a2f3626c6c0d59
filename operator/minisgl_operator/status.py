"""Children's state -> the ModelServer's status (conditions Ready, Progressing, Degraded)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from minisgl_operator.children import Problem
from minisgl_operator.meta import selector_string
from minisgl_operator.network import endpoint
from minisgl_operator.spec import ModelServerSpec
from minisgl_operator.workload import available_replicas, deployment_failed, failure_conditions


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }


def _unit(workload: Mapping[str, Any]) -> str:
    return "groups" if workload.get("kind") == "LeaderWorkerSet" else "pods"


def _rollout(deployment: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the workload is still moving, and a line saying how far it is."""
    want = int((deployment.get("spec") or {}).get("replicas") or 0)
    st = deployment.get("status") or {}
    have = int(st.get("replicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    available = available_replicas(deployment)
    pods = _unit(deployment)
    generation = int((deployment.get("metadata") or {}).get("generation") or 0)
    seen = int(st.get("observedGeneration") or 0)
    if seen < generation:
        return True, "the new pod template is not yet picked up"
    if updated < want:
        return True, f"{updated} of {want} {pods} updated"
    if have > updated:
        return True, f"{have - updated} old {pods} terminating"
    if available < want:
        return True, f"{available} of {want} {pods} available (loading the model)"
    return False, f"{available} of {want} {pods} available"


def _failure_message(deployment: Mapping[str, Any]) -> str:
    # The failing conditions' own words: a Progressing condition that is not a deadline only
    # says "Created new replica set ..." while pods are refused.
    messages = [str(c["message"]) for c in failure_conditions(deployment) if c.get("message")]
    return "; ".join(messages) or "the Deployment reports a failed rollout"


def deployment_is_lws(workload: Mapping[str, Any] | None) -> bool:
    return (workload or {}).get("kind") == "LeaderWorkerSet"


def with_transition_times(
    conditions: Sequence[dict[str, Any]], previous: Sequence[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """A condition's lastTransitionTime moves only when its status flips."""
    before = {c.get("type"): c for c in previous}
    out = []
    for c in conditions:
        old = before.get(c["type"])
        same = old is not None and old.get("status") == c["status"]
        time = old.get("lastTransitionTime") if same and old else None
        out.append({**c, "lastTransitionTime": time or now})
    return out


def compute_status(
    owner: Mapping[str, Any],
    spec: ModelServerSpec | None,
    deployment: Mapping[str, Any] | None,
    problems: Sequence[Problem],
    now: str,
    scale_down_held: bool = False,
) -> dict[str, Any]:
    """The status to write. `spec` is None when the spec is invalid (then `problems` says why);
    `deployment` is the workload (Deployment or LeaderWorkerSet) as the API server last
    returned it, or None."""
    generation = int(owner["metadata"].get("generation") or 0)
    st = (deployment or {}).get("status") or {}
    ready = int(st.get("readyReplicas") or 0)
    replicas = int(st.get("replicas") or 0)
    want = int(((deployment or {}).get("spec") or {}).get("replicas") or 0)
    problems = list(problems)
    if deployment is not None and deployment_failed(deployment):
        problems.append(Problem("RolloutFailed", _failure_message(deployment)))

    conditions = []
    if deployment is None:
        reason = problems[0].reason if problems else "Pending"
        conditions.append(_condition("Ready", False, reason, "no workload is running"))
        conditions.append(_condition("Progressing", False, reason, "nothing to roll out"))
    else:
        # An invalid edit leaves the last good Deployment serving: Ready reflects it.
        if ready > 0:
            conditions.append(
                _condition("Ready", True, "Serving", f"{ready} of {want} replicas ready")
            )
        elif want == 0:
            conditions.append(_condition("Ready", False, "ScaledToZero", "spec.replicas is 0"))
        else:
            conditions.append(_condition("Ready", False, "Loading", f"0 of {want} replicas ready"))
        moving, line = _rollout(deployment)
        if spec is None:
            reason = problems[0].reason if problems else "Pending"
            conditions.append(
                _condition("Progressing", False, reason, "the spec change cannot be rolled out")
            )
        elif scale_down_held:
            conditions.append(
                _condition(
                    "Progressing",
                    True,
                    "ScaleDownHeld",
                    f"scale-down waits for pods still loading; {line}",
                )
            )
        else:
            reason = "RollingOut" if moving else "Complete"
            conditions.append(_condition("Progressing", moving, reason, line))
    if problems:
        message = "; ".join(p.message for p in problems)
        conditions.append(_condition("Degraded", True, problems[0].reason, message))
    else:
        conditions.append(_condition("Degraded", False, "AsExpected", "no problems"))

    previous = (owner.get("status") or {}).get("conditions") or []
    name = owner["metadata"]["name"]
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": with_transition_times(conditions, previous, now),
        "replicas": replicas,
        "readyReplicas": ready,
        "replicaSummary": f"{ready}/{want}",
        # The serving pods: the leaders of a LeaderWorkerSet, whose metrics the HPA reads.
        "selector": selector_string(name, deployment_is_lws(deployment)),
    }
    if spec is not None:
        status["routing"] = spec.routing.mode
    if deployment is None:
        status["endpoint"] = None  # nothing of ours serves (null: a merge patch removes it)
    elif spec is not None:
        status["endpoint"] = endpoint(spec)
    return status
