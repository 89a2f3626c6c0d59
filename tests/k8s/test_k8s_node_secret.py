"""A multi-node ModelServer's node secret and NetworkPolicy: the Secret is random, made once
and kept (never rotated by a reconcile), owned by the ModelServer and mounted into every pod
of the group at the path its command names; the NetworkPolicy leaves the node ports
(29500-29503) to the ModelServer's own pods and the API port to everyone."""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path
from typing import Any

import pytest
from k8s_support import validate_k8s
from minisgl_operator import API_VERSION, KIND
from minisgl_operator.children import SECRET, Cluster, plan
from minisgl_operator.launch import DIST_INIT_PORT
from minisgl_operator.meta import labels
from minisgl_operator.reconcile import Config, reconcile
from minisgl_operator.spec import SpecError
from test_k8s_reconcile import FakeKube, cond, run

from minisgl.config import parse_server_args
from minisgl.engine.node_auth import load_node_secret

LWS = Cluster(leader_worker_set=True)
MULTI = {"model": "m", "engine": {"tensorParallelSize": 2, "nodes": 2}, "resources": {"gpus": 1}}
NODE_PORTS = range(DIST_INIT_PORT, DIST_INIT_PORT + 4)


def owner(spec: dict[str, Any], name: str = "qwen", uid: str = "uid-1") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": "llm", "uid": uid, "generation": 1},
        "spec": copy.deepcopy(spec),
    }


def children(spec: dict[str, Any], **kw: Any) -> dict[str, dict[str, Any]]:
    p = plan(owner(spec), LWS, **kw)
    for c in p.apply:
        validate_k8s(c)
    return {c["kind"]: c for c in p.apply}


def secret_value(obj: dict[str, Any]) -> str:
    (value,) = obj["data"].values()
    return base64.b64decode(value).decode()


def lws_expand(word: str) -> str:
    """What LeaderWorkerSet's environment makes of a word of the command (worker 1)."""
    return word.replace("$(LWS_WORKER_INDEX)", "1").replace("$(LWS_LEADER_ADDRESS)", "leader")


def pod_specs(objs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    lwt = objs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    return [lwt["leaderTemplate"], lwt["workerTemplate"]]


def test_a_multinode_group_gets_a_random_secret_owned_by_its_modelserver() -> None:
    objs = children(MULTI)
    secret = objs["Secret"]
    assert secret["metadata"]["name"] == "qwen-node-secret"
    (ref,) = secret["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"]) == (KIND, "uid-1", True)
    assert secret["immutable"] is True
    value = secret_value(secret)
    assert re.fullmatch(r"[0-9a-f]{64}", value)
    # Another ModelServer (or the same one planned afresh) gets another secret.
    assert secret_value(children(MULTI)["Secret"]) != value


def test_every_pod_of_the_group_reads_the_secret_from_where_its_command_says(
    tmp_path: Path,
) -> None:
    objs = children(MULTI)
    secret = objs["Secret"]
    for template in pod_specs(objs):
        pod = template["spec"]
        (c,) = pod["containers"]
        argv = [lws_expand(w) for w in c["command"][3:]]
        args = parse_server_args(argv)
        (mount,) = [
            m for m in c["volumeMounts"] if args.node_secret_file.startswith(m["mountPath"])
        ]
        assert mount["readOnly"] is True
        (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert vol["secret"]["secretName"] == secret["metadata"]["name"]
        key = args.node_secret_file[len(mount["mountPath"]) :].strip("/")
        assert key in secret["data"]
        # What the kubelet writes there is a secret the server accepts.
        path = tmp_path / key
        path.write_bytes(base64.b64decode(secret["data"][key]))
        i = argv.index("--node-secret-file")
        local = parse_server_args([*argv[: i + 1], str(path), *argv[i + 2 :]])
        assert load_node_secret(local) == secret_value(secret).encode()


def test_a_single_node_modelserver_has_neither_and_prunes_them() -> None:
    p = plan(owner({"model": "m"}), LWS)
    assert not {"Secret", "NetworkPolicy"} & {c["kind"] for c in p.apply}
    pruned = {(k.kind, n) for k, n in p.delete}
    assert {("Secret", "qwen-node-secret"), ("NetworkPolicy", "qwen-nodes")} <= pruned
    (c,) = children({"model": "m"})["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert "--node-secret-file" not in c["command"]


def test_extra_args_may_not_point_at_another_secret() -> None:
    spec = copy.deepcopy(MULTI)
    spec["engine"]["extraArgs"] = ["--node-secret-file", "/tmp/mine"]
    with pytest.raises(SpecError, match="may not set --node-secret-file"):
        plan(owner(spec), LWS)


def test_reconcile_keeps_the_secret_and_remakes_it_only_when_gone() -> None:
    kube = FakeKube(apis=("leaderworkersets",))
    ms = owner(MULTI)
    run(reconcile(ms, kube, Config()))
    key = ("Secret", "llm", "qwen-node-secret")
    first = copy.deepcopy(kube.objects[key])
    for _ in range(3):
        run(reconcile(ms, kube, Config()))
    assert kube.objects[key] == first  # same value, not even a new generation
    # A spec edit rolls the pods, not the secret.
    edited = owner({**MULTI, "engine": {**MULTI["engine"], "dtype": "bfloat16"}})
    run(reconcile(edited, kube, Config()))
    assert kube.objects[key] == first
    # Deleted by hand: a new one (new pods of the group then share it).
    run(kube.delete(SECRET, "llm", "qwen-node-secret"))
    run(reconcile(edited, kube, Config()))
    assert secret_value(kube.objects[key]) != secret_value(first)
    # Back to one node: the secret and the policy go.
    run(reconcile(owner({"model": "m"}), kube, Config()))
    assert not {"Secret", "NetworkPolicy"} & kube.kinds()


def test_a_secret_we_did_not_make_is_never_taken_over() -> None:
    kube = FakeKube(apis=("leaderworkersets",))
    theirs = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "qwen-node-secret", "namespace": "llm"},
        "data": {"node-secret": base64.b64encode(b"a" * 64).decode()},
    }
    run(kube.apply(theirs))
    status = run(reconcile(owner(MULTI), kube, Config()))
    assert "Secret qwen-node-secret exists and is not ours" in cond(status, "Degraded")["message"]
    assert kube.objects[("Secret", "llm", "qwen-node-secret")]["data"] == theirs["data"]


# -- the NetworkPolicy, read as the API server's network plugin reads it --------------------


def admits(policy: dict[str, Any], pod: dict[str, str], peer: dict[str, str], port: int) -> bool:
    """Does `policy` let a pod labelled `peer` (same namespace) reach `pod` on TCP `port`?
    A pod no policy selects is open; a selected one takes only what some rule allows."""
    spec = policy["spec"]
    if not spec["podSelector"]["matchLabels"].items() <= pod.items():
        return True
    assert spec["policyTypes"] == ["Ingress"]
    for rule in spec.get("ingress", []):
        sources = rule.get("from")
        from_ok = sources is None or any(
            s["podSelector"]["matchLabels"].items() <= peer.items() for s in sources
        )
        ports = rule.get("ports")
        port_ok = ports is None or any(p["port"] == port and p["protocol"] == "TCP" for p in ports)
        if from_ok and port_ok:
            return True
    return False


def test_node_ports_accept_only_pods_of_the_same_modelserver() -> None:
    objs = children(MULTI)
    policy = objs["NetworkPolicy"]
    (ref,) = policy["metadata"]["ownerReferences"]
    assert ref["uid"] == "uid-1"
    strangers = [{"app": "curl"}, labels("other")]  # any pod; another ModelServer's pod
    for template in pod_specs(objs):
        pod = template["metadata"]["labels"]
        for peer_template in pod_specs(objs):  # leader <-> worker, both ways
            peer = peer_template["metadata"]["labels"]
            assert all(admits(policy, pod, peer, p) for p in NODE_PORTS)
            assert admits(policy, pod, peer, 41234)  # the collectives pick their own ports
        (c,) = template["spec"]["containers"]
        (http,) = [p["containerPort"] for p in c["ports"] if p["name"] == "http"]
        for stranger in strangers:
            assert not any(admits(policy, pod, stranger, p) for p in NODE_PORTS)
            assert not admits(policy, pod, stranger, 41234)
            assert admits(policy, pod, stranger, http)  # clients, Prometheus, the picker
