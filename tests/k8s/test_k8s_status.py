"""Children's state -> ModelServer status."""

from __future__ import annotations

from typing import Any

from minisgl_operator.children import Problem
from minisgl_operator.spec import parse_spec
from minisgl_operator.status import compute_status

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"
SPEC = parse_spec("qwen", "llm", {"model": "m"})


def owner(status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "qwen", "namespace": "llm", "generation": 7},
        "status": status or {},
    }


def dep(
    want: int, ready: int, updated: int | None = None, have: int | None = None, **st: Any
) -> dict:
    have = want if have is None else have
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": want},
        "status": {
            "observedGeneration": 2,
            "replicas": have,
            "updatedReplicas": want if updated is None else updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            **st,
        },
    }


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    (c,) = [c for c in status["conditions"] if c["type"] == type_]
    return c


def test_serving() -> None:
    s = compute_status(owner(), SPEC, dep(2, 2), [], NOW)
    assert (cond(s, "Ready")["status"], cond(s, "Ready")["reason"]) == ("True", "Serving")
    assert cond(s, "Progressing")["status"] == "False"
    assert cond(s, "Degraded")["status"] == "False"
    assert (s["replicas"], s["readyReplicas"], s["replicaSummary"]) == (2, 2, "2/2")
    assert s["observedGeneration"] == 7
    assert s["endpoint"] == "http://qwen.llm.svc:8000"
    assert s["selector"] == "app.kubernetes.io/name=minisgl-server,minisgl.io/modelserver=qwen"


def test_loading_and_rolling_out() -> None:
    s = compute_status(owner(), SPEC, dep(1, 0), [], NOW)
    assert cond(s, "Ready")["reason"] == "Loading"
    assert cond(s, "Progressing")["status"] == "True"
    assert "loading" in cond(s, "Progressing")["message"]
    r = compute_status(owner(), SPEC, dep(2, 2, updated=1, have=3), [], NOW)
    assert (cond(r, "Ready")["status"], cond(r, "Progressing")["reason"]) == ("True", "RollingOut")
    stale = dep(2, 2)
    stale["metadata"]["generation"] = 3
    assert cond(compute_status(owner(), SPEC, stale, [], NOW), "Progressing")["status"] == "True"


def test_scale_down_held_and_zero() -> None:
    s = compute_status(owner(), SPEC, dep(3, 2), [], NOW, scale_down_held=True)
    assert cond(s, "Progressing")["reason"] == "ScaleDownHeld"
    z = compute_status(owner(), SPEC, dep(0, 0), [], NOW)
    assert cond(z, "Ready")["reason"] == "ScaledToZero"


def test_invalid_spec_is_degraded_with_the_message() -> None:
    s = compute_status(owner(), None, None, [Problem("InvalidSpec", "spec.model is required")], NOW)
    d = cond(s, "Degraded")
    assert (d["status"], d["reason"], d["message"]) == (
        "True",
        "InvalidSpec",
        "spec.model is required",
    )
    assert cond(s, "Ready")["status"] == "False"
    assert s["endpoint"] is None
    # A bad edit keeps the last good Deployment serving, and says so.
    kept = compute_status(owner(), None, dep(1, 1), [Problem("InvalidSpec", "x")], NOW)
    assert cond(kept, "Ready")["status"] == "True"
    assert cond(kept, "Progressing")["reason"] == "InvalidSpec"


def test_failed_rollout_is_degraded() -> None:
    failing = dep(
        1,
        0,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "ReplicaSet has timed out progressing.",
            }
        ],
    )
    s = compute_status(owner(), SPEC, failing, [], NOW)
    assert cond(s, "Degraded")["reason"] == "RolloutFailed"
    assert "timed out" in cond(s, "Degraded")["message"]


def test_pods_the_deployment_cannot_create_are_degraded_with_the_reason() -> None:
    """A quota (or admission policy) refusing the pods: the Deployment's conditions, as the
    controller-manager wrote them on a real API server, Progressing first."""
    refused = dep(
        1,
        0,
        conditions=[
            {
                "type": "Progressing",
                "status": "True",
                "reason": "NewReplicaSetCreated",
                "message": 'Created new replica set "qwen-7f46f7fd7f"',
            },
            {
                "type": "Available",
                "status": "False",
                "reason": "MinimumReplicasUnavailable",
                "message": "Deployment does not have minimum availability.",
            },
            {
                "type": "ReplicaFailure",
                "status": "True",
                "reason": "FailedCreate",
                "message": 'pods "qwen-7f46f7fd7f-qtvm6" is forbidden: exceeded quota: nopods',
            },
        ],
    )
    degraded = cond(compute_status(owner(), SPEC, refused, [], NOW), "Degraded")
    assert degraded["reason"] == "RolloutFailed"
    assert (
        degraded["message"] == 'pods "qwen-7f46f7fd7f-qtvm6" is forbidden: exceeded quota: nopods'
    )


def test_several_problems_are_all_reported() -> None:
    s = compute_status(owner(), SPEC, dep(1, 1), [Problem("A", "one"), Problem("B", "two")], NOW)
    assert cond(s, "Degraded")["reason"] == "A"
    assert cond(s, "Degraded")["message"] == "one; two"


def test_transition_time_moves_only_when_status_flips() -> None:
    first = compute_status(owner(), SPEC, dep(1, 0), [], NOW)
    same = compute_status(owner(first), SPEC, dep(1, 0), [], LATER)
    assert cond(same, "Ready")["lastTransitionTime"] == NOW
    flipped = compute_status(owner(first), SPEC, dep(1, 1), [], LATER)
    assert cond(flipped, "Ready")["lastTransitionTime"] == LATER
    assert cond(flipped, "Degraded")["lastTransitionTime"] == NOW


def test_ingress_endpoint() -> None:
    spec = parse_spec(
        "qwen", "llm", {"model": "m", "ingress": {"host": "q.example.com", "tls": True}}
    )
    assert compute_status(owner(), spec, dep(1, 1), [], NOW)["endpoint"] == "https://q.example.com"
