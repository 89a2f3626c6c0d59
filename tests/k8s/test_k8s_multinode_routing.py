"""Multi-node ModelServers (LeaderWorkerSet) and routing through the Gateway API Inference
Extension (InferencePool, endpoint picker, HTTPRoute): rendered children, validated against
the upstream CRDs, and the reconcile behaviour when those CRDs are missing."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_support import ROOT, validate_k8s, validate_modelserver
from minisgl_operator import API_VERSION, KIND, queries
from minisgl_operator.children import Cluster, Plan, plan
from minisgl_operator.launch import DIST_INIT_PORT
from minisgl_operator.reconcile import Config, reconcile
from minisgl_operator.routing import EPP_GRPC_PORT, PickerConfig
from minisgl_operator.spec import SpecError
from test_k8s_reconcile import FakeKube, cond, ms, run

from minisgl.config import parse_server_args
from minisgl.engine.multinode import check_args

UID = "uid-1"
EVERYTHING = Cluster(
    leader_worker_set=True,
    inference_pool=True,
    gateway_api=True,
    picker=PickerConfig(image="epp.example/epp:v9", extra_args=("--v", "3")),
)
ALL_APIS = ("leaderworkersets", "inferencepools", "httproutes")
LEADER = {"leaderworkerset.sigs.k8s.io/worker-index": "0"}


def example(name: str) -> dict[str, Any]:
    obj = yaml.safe_load((ROOT / "examples" / name).read_text())
    obj["metadata"].update(namespace="llm", uid=UID, generation=1)
    return obj


def make(owner: dict[str, Any], cluster: Cluster = EVERYTHING) -> Plan:
    validate_modelserver({k: v for k, v in owner.items() if k != "status"})
    p = plan(owner, cluster)
    for c in p.apply:
        validate_k8s(c)
    return p


def kinds(p: Plan) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in p.apply}


def kubelet_expand(word: str, env: dict[str, str]) -> str:
    """$(VAR) expansion as the kubelet does it in command and args ($$ escapes)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, word)


def split_multi_node(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The server's own flags, and the two each pod of a group adds."""
    rest, extra = list(argv), {}
    for flag in ("--node-rank", "--dist-init-addr"):
        i = rest.index(flag)
        extra[flag] = rest[i + 1]
        del rest[i : i + 2]
    return rest, extra


# -- multi-node ------------------------------------------------------------------------------


def test_multinode_example_renders_a_leader_worker_set_instead_of_a_deployment() -> None:
    p = make(example("modelserver-multinode.yaml"))
    objs = kinds(p)
    lws = objs[("LeaderWorkerSet", "qwen3-235b")]
    assert ("Deployment", "qwen3-235b") not in objs
    # A Deployment from when the ModelServer had one node is pruned.
    assert any(k.kind == "Deployment" and n == "qwen3-235b" for k, n in p.delete)
    spec = lws["spec"]
    assert spec["replicas"] == 1
    assert spec["startupPolicy"] == "LeaderCreated"
    # Never the Shared headless Service, which would take our Service's name.
    assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    lwt = spec["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    for key in ("leaderTemplate", "workerTemplate"):
        (c,) = lwt[key]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8  # 16 ranks over 2 pods
        assert c["startupProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert {"name": "dist", "containerPort": DIST_INIT_PORT, "protocol": "TCP"} in c["ports"]
    # Only the leader serves the API: only it is scraped.
    assert "prometheus.io/scrape" in lwt["leaderTemplate"]["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in lwt["workerTemplate"]["metadata"]["annotations"]


@pytest.mark.parametrize("index", [0, 1])
def test_each_pod_gets_its_rank_and_the_leader_address_from_lws_env(index: int) -> None:
    p = make(example("modelserver-multinode.yaml"))
    lws = kinds(p)[("LeaderWorkerSet", "qwen3-235b")]
    key = "leaderTemplate" if index == 0 else "workerTemplate"
    (c,) = lws["spec"]["leaderWorkerTemplate"][key]["spec"]["containers"]
    # What LeaderWorkerSet sets in every pod of group 0.
    # (UniquePerReplica: <leader pod>.<leader pod's headless Service>.<namespace>).
    leader = "qwen3-235b-0.qwen3-235b-0.llm"
    env = {"LWS_LEADER_ADDRESS": leader, "LWS_WORKER_INDEX": str(index)}
    argv = [kubelet_expand(w, env) for w in c["command"]]
    assert argv[:3] == ["python", "-m", "minisgl"]
    server, multi = split_multi_node(argv[3:])
    assert multi == {
        "--node-rank": str(index),
        "--dist-init-addr": f"{leader}:{DIST_INIT_PORT}",
    }
    s = parse_server_args(server)
    assert (s.tp_size, s.nnodes, s.model, s.device) == (16, 2, "Qwen/Qwen3-235B-A22B", "cuda")
    # What the pod finally runs is a layout the server accepts.
    final = parse_server_args(argv[3:])
    assert (final.node_rank, final.dist_init_addr) == (index, f"{leader}:{DIST_INIT_PORT}")
    check_args(final)


def test_service_selects_leaders_only_and_status_selector_follows() -> None:
    p = make(example("modelserver-multinode.yaml"))
    svc = kinds(p)[("Service", "qwen3-235b")]
    assert svc["spec"]["selector"].items() >= LEADER.items()
    pod_labels = kinds(p)[("LeaderWorkerSet", "qwen3-235b")]["spec"]["leaderWorkerTemplate"][
        "leaderTemplate"
    ]["metadata"]["labels"]
    assert {k: v for k, v in svc["spec"]["selector"].items() if k not in LEADER}.items() <= (
        pod_labels.items()
    )


def test_every_child_is_owned_by_the_modelserver() -> None:
    owner = example("modelserver-multinode.yaml")
    owner["spec"]["routing"] = {"inferencePool": True, "gatewayRef": {"name": "gw"}}
    for c in make(owner).apply:
        (ref,) = c["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            KIND,
            "qwen3-235b",
            UID,
            True,
        )
        assert ref["apiVersion"] == API_VERSION


@pytest.mark.parametrize(
    "engine,resources,why",
    [
        ({"tensorParallelSize": 6, "nodes": 4}, {}, "must divide by engine.nodes"),
        ({"tensorParallelSize": 16, "nodes": 2}, {"gpus": 4}, "at least"),
        ({"nodes": 0}, {}, "engine.nodes must be >= 1"),
    ],
)
def test_bad_node_splits_are_spec_errors(
    engine: dict[str, Any], resources: dict[str, Any], why: str
) -> None:
    with pytest.raises(SpecError, match=why):
        plan(ms({"model": "m", "engine": engine, "resources": resources}), EVERYTHING)


def test_gpus_default_to_the_ranks_of_one_pod_and_cpu_pods_still_split() -> None:
    p = plan(ms({"model": "m", "engine": {"tensorParallelSize": 4, "nodes": 4}}), EVERYTHING)
    lwt = kinds(p)[("LeaderWorkerSet", "qwen")]["spec"]["leaderWorkerTemplate"]
    (c,) = lwt["workerTemplate"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and lwt["size"] == 4
    cpu = plan(ms({"model": "m", "engine": {"tensorParallelSize": 2, "nodes": 2},
                   "resources": {"gpus": 0}}), EVERYTHING)  # fmt: skip
    lwt = kinds(cpu)[("LeaderWorkerSet", "qwen")]["spec"]["leaderWorkerTemplate"]
    (c,) = lwt["leaderTemplate"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert c["command"][c["command"].index("--device") + 1] == "cpu"


@pytest.mark.parametrize(
    "extra", [["--dist-init-addr", "10.0.0.1:1234"], ["--nnodes", "4"], ["--node-rank", "1"]]
)
def test_extra_args_may_not_take_over_the_group_layout(extra: list[str]) -> None:
    spec = {"model": "m", "engine": {"tensorParallelSize": 2, "nodes": 2, "extraArgs": extra}}
    with pytest.raises(SpecError, match=f"may not set {extra[0]}"):
        plan(ms(spec), EVERYTHING)


# -- routing ---------------------------------------------------------------------------------


def test_routed_example_renders_pool_picker_and_route() -> None:
    p = make(example("modelserver-routed.yaml"))
    objs = kinds(p)
    pool = objs[("InferencePool", "qwen3-8b")]["spec"]
    svc = objs[("Service", "qwen3-8b")]["spec"]
    assert pool["selector"]["matchLabels"] == svc["selector"]  # every pod: single-node
    assert "leaderworkerset.sigs.k8s.io/worker-index" not in pool["selector"]["matchLabels"]
    assert pool["targetPorts"] == [{"number": 8000}]
    ref = pool["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]) == (
        "Service",
        "qwen3-8b-epp",
        {"number": EPP_GRPC_PORT},
    )
    epp_svc = objs[("Service", "qwen3-8b-epp")]["spec"]
    assert EPP_GRPC_PORT in [port["port"] for port in epp_svc["ports"]]
    epp = objs[("Deployment", "qwen3-8b-epp")]["spec"]["template"]
    assert epp_svc["selector"].items() <= epp["metadata"]["labels"].items()
    (c,) = epp["spec"]["containers"]
    assert c["image"] == "epp.example/epp:v9"
    args = c["args"]

    def arg(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert (arg("--pool-name"), arg("--pool-namespace")) == ("qwen3-8b", "llm")
    assert arg("--total-queued-requests-metric") == queries.WAITING_GAUGE
    assert arg("--kv-cache-usage-percentage-metric") == queries.KV_USAGE_GAUGE
    assert arg("--total-running-requests-metric") == queries.RUNNING_GAUGE
    assert args[-2:] == ["--v", "3"]  # the operator's --epp-arg words come last
    # The picker runs as its own account, bound to a Role that reads pods and pools.
    sa = objs[("ServiceAccount", "qwen3-8b-epp")]
    assert epp["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    binding = objs[("RoleBinding", "qwen3-8b-epp")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "qwen3-8b-epp", "namespace": "llm"}
    ]
    role = objs[("Role", "qwen3-8b-epp")]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    granted = {
        (g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    route = objs[("HTTPRoute", "qwen3-8b")]["spec"]
    (parent,) = route["parentRefs"]
    assert (parent["kind"], parent["name"], parent["namespace"]) == (
        "Gateway",
        "inference-gateway",
        "gateway",
    )
    (rule,) = route["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "qwen3-8b"}
    ]


def test_the_picker_metrics_are_the_servers_gauges() -> None:
    from minisgl.metrics import names

    assert queries.WAITING_GAUGE == names.NUM_WAITING
    assert queries.RUNNING_GAUGE == names.NUM_RUNNING
    assert queries.KV_USAGE_GAUGE == names.KV_USAGE


def test_multinode_pool_selects_leaders_only() -> None:
    owner = example("modelserver-multinode.yaml")
    owner["spec"]["routing"] = {"inferencePool": True}
    objs = kinds(make(owner))
    selector = objs[("InferencePool", "qwen3-235b")]["spec"]["selector"]["matchLabels"]
    assert selector.items() >= LEADER.items()
    assert selector == objs[("Service", "qwen3-235b")]["spec"]["selector"]
    assert ("HTTPRoute", "qwen3-235b") not in objs


def test_gateway_namespace_defaults_to_the_modelservers() -> None:
    spec = {"model": "m", "routing": {"inferencePool": True, "gatewayRef": {"name": "gw"}}}
    route = kinds(make(ms(spec)))[("HTTPRoute", "qwen")]
    assert route["spec"]["parentRefs"][0]["namespace"] == "llm"


def test_gateway_ref_needs_the_pool() -> None:
    with pytest.raises(SpecError, match="needs routing.inferencePool"):
        plan(ms({"model": "m", "routing": {"gatewayRef": {"name": "gw"}}}), EVERYTHING)


# -- reconcile against a cluster with and without the CRDs ------------------------------------


def test_without_lws_nothing_is_created_and_the_reason_is_given() -> None:
    kube = FakeKube()
    owner = ms({"model": "m", "engine": {"tensorParallelSize": 2, "nodes": 2}})
    status = run(reconcile(owner, kube, Config()))
    assert kube.objects == {}
    degraded = cond(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "LeaderWorkerSetNotInstalled")
    assert cond(status, "Ready")["status"] == "False"


def test_switching_nodes_replaces_the_workload_and_back() -> None:
    kube = FakeKube(apis=ALL_APIS)
    single = ms({"model": "m", "engine": {"tensorParallelSize": 2}})
    run(reconcile(single, kube, Config()))
    assert ("Deployment", "llm", "qwen") in kube.objects
    multi = copy.deepcopy(single)
    multi["spec"]["engine"]["nodes"] = 2
    status = run(reconcile(multi, kube, Config()))
    assert ("Deployment", "llm", "qwen") not in kube.objects
    assert ("LeaderWorkerSet", "llm", "qwen") in kube.objects
    svc = kube.objects[("Service", "llm", "qwen")]
    assert svc["spec"]["selector"].items() >= LEADER.items()
    assert "leaderworkerset.sigs.k8s.io/worker-index=0" in status["selector"].split(",")
    run(reconcile(single, kube, Config()))
    assert ("LeaderWorkerSet", "llm", "qwen") not in kube.objects
    assert ("Deployment", "llm", "qwen") in kube.objects
    assert "worker-index" not in str(kube.objects[("Service", "llm", "qwen")]["spec"])


def test_switch_to_multinode_without_lws_keeps_the_deployment_serving() -> None:
    kube = FakeKube()
    single = ms({"model": "m", "engine": {"tensorParallelSize": 2}})
    run(reconcile(single, kube, Config()))
    kube.objects[("Deployment", "llm", "qwen")]["status"] = {"replicas": 1, "readyReplicas": 1}
    before = copy.deepcopy(kube.objects)
    multi = copy.deepcopy(single)
    multi["spec"]["engine"]["nodes"] = 2
    status = run(reconcile(multi, kube, Config()))
    assert kube.objects == before
    assert cond(status, "Degraded")["reason"] == "LeaderWorkerSetNotInstalled"
    assert cond(status, "Ready")["status"] == "True"  # the old pods still serve


def test_status_counts_groups_of_a_leader_worker_set() -> None:
    kube = FakeKube(apis=ALL_APIS)
    owner = ms({"model": "m", "replicas": 3, "engine": {"tensorParallelSize": 2, "nodes": 2}})
    run(reconcile(owner, kube, Config()))
    lws = kube.objects[("LeaderWorkerSet", "llm", "qwen")]
    seen = lws["metadata"]["generation"]
    lws["status"] = {
        "replicas": 3,
        "readyReplicas": 2,
        "updatedReplicas": 3,
        "observedGeneration": seen,
    }
    status = run(reconcile(owner, kube, Config()))
    assert (status["replicas"], status["readyReplicas"], status["replicaSummary"]) == (3, 2, "2/3")
    assert cond(status, "Ready")["status"] == "True"
    progressing = cond(status, "Progressing")
    assert progressing["status"] == "True" and "2 of 3 groups available" in progressing["message"]
    assert status["routing"] == "Service"


def test_without_the_inference_pool_crd_the_service_serves_and_it_is_degraded() -> None:
    kube = FakeKube()
    owner = ms({"model": "m", "routing": {"inferencePool": True}})
    status = run(reconcile(owner, kube, Config()))
    assert kube.kinds() == {"Deployment", "Service"}
    assert ("Deployment", "llm", "qwen-epp") not in kube.objects
    assert cond(status, "Degraded")["reason"] == "InferencePoolNotInstalled"


def test_without_gateway_api_the_pool_is_made_and_the_route_is_reported() -> None:
    kube = FakeKube(apis=("inferencepools",))
    owner = ms({"model": "m", "routing": {"inferencePool": True, "gatewayRef": {"name": "g"}}})
    status = run(reconcile(owner, kube, Config()))
    assert "InferencePool" in kube.kinds() and "HTTPRoute" not in kube.kinds()
    assert cond(status, "Degraded")["reason"] == "GatewayAPINotInstalled"


def test_routing_on_then_off_prunes_the_pool_and_its_picker() -> None:
    kube = FakeKube(apis=ALL_APIS)
    routed = ms({"model": "m", "routing": {"inferencePool": True, "gatewayRef": {"name": "g"}}})
    status = run(reconcile(routed, kube, Config(picker=PickerConfig(image="x/epp:1"))))
    assert status["routing"] == "InferencePool+Gateway llm/g"
    assert cond(status, "Degraded")["status"] == "False"
    assert {"InferencePool", "HTTPRoute", "ServiceAccount", "Role", "RoleBinding"} <= kube.kinds()
    epp = kube.objects[("Deployment", "llm", "qwen-epp")]
    assert epp["spec"]["template"]["spec"]["containers"][0]["image"] == "x/epp:1"
    plain = ms({"model": "m"})
    status = run(reconcile(plain, kube, Config()))
    assert kube.kinds() == {"Deployment", "Service"}
    assert set(kube.objects) == {("Deployment", "llm", "qwen"), ("Service", "llm", "qwen")}
    assert status["routing"] == "Service"


def test_examples_are_valid_modelservers() -> None:
    for path in sorted(Path(ROOT / "examples").glob("modelserver*.yaml")):
        make(example(path.name))


def test_kinds_the_chart_did_not_grant_are_left_alone() -> None:
    # CRDs installed, but the operator installed without rbac.inferencePool: a plain
    # ModelServer must still reconcile cleanly (nothing of those kinds can be ours).
    kube = FakeKube(apis=ALL_APIS)
    kube.forbidden = {"InferencePool", "HTTPRoute", "ServiceAccount", "Role", "RoleBinding"}
    status = run(reconcile(ms({"model": "m"}), kube, Config()))
    assert cond(status, "Degraded")["status"] == "False"
    assert kube.kinds() == {"Deployment", "Service"}


def test_multinode_names_leave_room_for_the_pods_lws_names() -> None:
    owner = ms({"model": "m", "engine": {"tensorParallelSize": 2, "nodes": 2}})
    owner["metadata"]["name"] = "q" * 46
    with pytest.raises(SpecError, match="at most 45 characters"):
        plan(owner, EVERYTHING)
    owner["metadata"]["name"] = "q" * 45
    plan(owner, EVERYTHING)
    owner["spec"]["engine"] = {}
    owner["metadata"]["name"] = "q" * 57  # one node: the usual limit
    plan(owner, EVERYTHING)
