"""The Helm chart, rendered by real Helm (helm-python-sdk = Helm v4 as a library)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from k8s_support import CHART, ROOT, validate_k8s
from minisgl_operator import queries
from minisgl_operator.children import LEADER_WORKER_SET, Cluster, plan
from minisgl_operator.spec import parse_spec

KEDA_CLUSTER = {"keda": True, "prometheus_url": "http://prometheus.monitoring:9090"}

FULL = {
    "operator": {"prometheusUrl": "http://prometheus.monitoring:9090", "verbose": True},
    "modelServer": {
        "enabled": True,
        "name": "qwen",
        "spec": {
            "model": "Qwen/Qwen3-0.6B",
            "engine": {"speculative": {"algorithm": "eagle3", "draftModelPath": "org/head"}},
            "autoscaling": {"maxReplicas": 3, "targets": {"ttftP95Seconds": 0.5}},
            "ingress": {"host": "qwen.example.com", "tls": True},
        },
    },
    "monitoring": {
        "podMonitor": {"enabled": True, "labels": {"release": "kps"}},
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
    },
    "prometheusAdapter": {"rulesConfigMap": {"enabled": True}},
    "imagePullSecrets": [{"name": "regcred"}],
}
COMBINATIONS = {
    "default": {},
    "full": FULL,
    "namespaced": {"operator": {"watchNamespace": "team-a"}},
    "no-rbac-no-dashboards": {
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "existing"},
        "dashboards": {"enabled": False},
    },
    "external-test-endpoint": {"tests": {"endpoint": "http://qwen.llm.svc:8000"}},
    "routing": {
        "rbac": {"inferencePool": True},
        "operator": {"endpointPicker": {"extraArgs": ["--v", "3"]}},
        "modelServer": {
            "enabled": True,
            "spec": {"model": "Qwen/Qwen3-8B", "routing": {"inferencePool": True}},
        },
    },
}


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


@pytest.mark.parametrize("values", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_lint_strict_is_clean(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), values, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("values", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_every_rendered_object_is_valid(render, values: dict[str, Any]) -> None:
    objs = render(values)
    assert objs
    for obj in objs:
        validate_k8s(obj)
        assert obj["metadata"].get("namespace", "llm") in ("llm", "team-a")


def test_default_install_is_operator_crd_rbac_and_dashboards(render) -> None:
    objs = render()
    kinds = sorted(o["kind"] for o in objs)
    assert "Deployment" in kinds and "ServiceAccount" in kinds
    assert "ClusterRole" in kinds and "ClusterRoleBinding" in kinds
    # Off by default: nothing that needs Prometheus Operator or a ModelServer.
    for absent in ("PodMonitor", "ServiceMonitor", "PrometheusRule", "ModelServer", "Pod"):
        assert absent not in kinds
    with helm.Chart.load(str(CHART)) as chart:
        assert [c["name"] for c in chart.crds] == ["crds/modelservers.minisgl.io.yaml"]


def test_operator_deployment_is_locked_down(render) -> None:
    (dep,) = by_kind(render(FULL), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--prometheus-url=http://prometheus.monitoring:9090" in c["args"]
    assert "--verbose" in c["args"]
    assert not any(a.startswith("--namespace") for a in c["args"])
    assert c["image"] == "ghcr.io/minisgl/minisgl-operator:0.1.0"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_namespaced_operator_gets_a_role_in_that_namespace_only(render) -> None:
    objs = render(COMBINATIONS["namespaced"])
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    (role,) = by_kind(objs, "Role")
    (binding,) = by_kind(objs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "team-a"
    assert binding["subjects"][0]["namespace"] == "llm"  # the operator runs in the release ns
    (dep,) = by_kind(objs, "Deployment")
    assert "--namespace=team-a" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def granted(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    return {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }


def test_rbac_is_least_privilege(render) -> None:
    (role,) = by_kind(render(), "ClusterRole")
    verbs = granted(role)
    assert all("*" not in v for v in verbs.values())
    assert all("*" not in k[1] for k in verbs)
    assert verbs[("minisgl.io", "modelservers")] == {"get", "list", "watch", "patch"}
    assert verbs[("minisgl.io", "modelservers/status")] == {"patch"}
    # kopf posts core v1 Events, never patches them nor uses events.k8s.io.
    assert verbs[("", "events")] == {"create"}
    assert not any(g == "events.k8s.io" for g, _ in verbs)
    assert verbs[("apps", "deployments")] == {"get", "list", "watch", "create", "patch", "delete"}
    assert verbs[("keda.sh", "scaledobjects")] == {"get", "create", "patch", "delete"}
    assert verbs[("leaderworkerset.x-k8s.io", "leaderworkersets")] == verbs[("apps", "deployments")]
    # Secrets only for multi-node groups' node secrets, by name: never list or watch them.
    assert verbs[("", "secrets")] == {"get", "create", "patch", "delete"}
    assert verbs[("networking.k8s.io", "networkpolicies")] == {"get", "create", "patch", "delete"}
    # Never pods, or anything the operator does not touch.
    assert not any(r in ("pods", "configmaps") for _, r in verbs)
    assert not any(g.startswith(("inference.", "gateway.", "rbac.")) for g, _ in verbs)


def test_routing_rbac_is_opt_in_and_reads_pods_only(render) -> None:
    (role,) = by_kind(render({"rbac": {"inferencePool": True}}), "ClusterRole")
    verbs = granted(role)
    # The picker's Role reads pods and pools: the operator may grant only what it holds.
    assert verbs[("", "pods")] == {"get", "list", "watch"}
    assert {"create", "patch", "delete"} <= verbs[("inference.networking.k8s.io", "inferencepools")]
    assert verbs[("gateway.networking.k8s.io", "httproutes")] == {
        "get",
        "create",
        "patch",
        "delete",
    }
    for kind in ("roles", "rolebindings"):
        assert "escalate" not in verbs[("rbac.authorization.k8s.io", kind)]
        assert "bind" not in verbs[("rbac.authorization.k8s.io", kind)]
    assert not any(r == "configmaps" for _, r in verbs)
    (role,) = by_kind(render({"rbac": {"leaderWorkerSet": False}}), "ClusterRole")
    assert not any(g == "leaderworkerset.x-k8s.io" for g, _ in granted(role))
    assert not any(r in ("secrets", "networkpolicies") for _, r in granted(role))


def test_without_the_leader_worker_set_grant_the_operator_does_not_watch_them(render) -> None:
    """kopf stops the operator when a watch stays forbidden: no grant, no watch."""

    def env(values: dict[str, Any]) -> dict[str, str]:
        (dep,) = by_kind(render(values), "Deployment")
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e["value"] for e in container.get("env", [])}

    assert "MINISGL_OPERATOR_WATCH_LEADER_WORKER_SETS" not in env({})
    off = env({"rbac": {"leaderWorkerSet": False}})
    assert off["MINISGL_OPERATOR_WATCH_LEADER_WORKER_SETS"] == "0"


def test_endpoint_picker_values_become_operator_flags(render) -> None:
    values = {"operator": {"endpointPicker": {"image": "r/epp:v2", "extraArgs": ["--v", "3"]}}}
    (dep,) = by_kind(render(values), "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--epp-image=r/epp:v2" in args
    assert args[args.index("--epp-arg=--v") + 1] == "--epp-arg=3"
    from minisgl_operator.__main__ import build_parser

    parsed = build_parser().parse_args(args)
    assert (parsed.epp_image, parsed.epp_arg) == ("r/epp:v2", ["--v", "3"])


def test_dashboards_become_labelled_configmaps(render) -> None:
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    cms = [c for c in by_kind(render(), "ConfigMap") if "dashboard" in c["metadata"]["name"]]
    assert sorted(k for c in cms for k in c["data"]) == files
    for cm in cms:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert not [
        c
        for c in by_kind(render({"dashboards": {"enabled": False}}), "ConfigMap")
        if "dashboard" in c["metadata"]["name"]
    ]


def test_monitoring_objects_and_rules(render) -> None:
    objs = render(FULL)
    (pm,) = by_kind(objs, "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "kps"
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "minisgl-server"
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    (sm,) = by_kind(objs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    (rule,) = by_kind(objs, "PrometheusRule")
    source = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert rule["spec"]["groups"] == source["groups"]


def _prometheus_label(name: str) -> str:
    """A pod label as Prometheus' Kubernetes discovery names it."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _kept(relabelings: list[dict[str, Any]], labels: dict[str, str]) -> bool:
    """Prometheus' keep/drop relabeling: the source labels' values joined by ';' (absent: ''),
    matched by the whole regex."""
    for r in relabelings:
        value = ";".join(labels.get(s, "") for s in r["sourceLabels"])
        matched = re.fullmatch(r.get("regex", "(.*)"), value) is not None
        if matched != (r["action"] == "keep"):
            return False
    return True


def _workload(spec: dict[str, Any]) -> dict[str, Any]:
    owner = {"metadata": {"name": "qwen", "namespace": "llm", "uid": "u"}, "spec": spec}
    (out,) = [
        c
        for c in plan(owner, Cluster(leader_worker_set=True)).apply
        if c["kind"] in ("Deployment", LEADER_WORKER_SET.kind)
    ]
    return out


def test_pod_monitor_scrapes_the_pods_that_serve_metrics(render) -> None:
    """The PodMonitor's selector matches every server pod, a multi-node group's workers too;
    those serve only /health (a /metrics scrape is a 404, a target down), so relabeling keeps
    the leaders and single pods only."""
    (pm,) = by_kind(render(FULL), "PodMonitor")
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    relabelings = endpoint.get("relabelings", [])
    selector = pm["spec"]["selector"]["matchLabels"]
    group = _workload({"model": "m", "engine": {"tensorParallelSize": 4, "nodes": 2}})
    templates = group["spec"]["leaderWorkerTemplate"]
    index = "leaderworkerset.sigs.k8s.io/worker-index"  # set by LeaderWorkerSet on every pod
    pods = {
        "leader": {**templates["leaderTemplate"]["metadata"]["labels"], index: "0"},
        "worker": {**templates["workerTemplate"]["metadata"]["labels"], index: "1"},
        "single": _workload({"model": "m"})["spec"]["template"]["metadata"]["labels"],
    }
    for role, labels in pods.items():
        assert selector.items() <= labels.items(), role
        seen = {_prometheus_label(k): v for k, v in labels.items()}
        assert _kept(relabelings, seen) == (role != "worker"), role


def test_prometheus_adapter_rules_serve_what_the_hpa_asks_for(render) -> None:
    values = yaml.safe_load((CHART / "files" / "prometheus-adapter-values.yaml").read_text())
    served = {r["name"]["as"] for r in values["rules"]["custom"]}
    assert {queries.ADAPTER_TTFT_P95, queries.ADAPTER_TPOT_P95, queries.ADAPTER_WAITING} <= served
    (cm,) = [c for c in by_kind(render(FULL), "ConfigMap") if "adapter" in c["metadata"]["name"]]
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["rules"] == values["rules"]["custom"]


def test_modelserver_from_values_and_helm_test(render) -> None:
    objs = render(FULL)
    (ms,) = by_kind(objs, "ModelServer")
    assert ms["metadata"]["name"] == "qwen"
    assert ms["spec"]["autoscaling"]["maxReplicas"] == 3
    (pod,) = by_kind(objs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["containers"][0]["args"][-1] == "http://qwen.llm.svc:8000/v1/models"
    (ext,) = by_kind(render(COMBINATIONS["external-test-endpoint"]), "Pod")
    assert ext["spec"]["containers"][0]["args"][-1] == "http://qwen.llm.svc:8000/v1/models"


def test_modelserver_from_values_goes_where_a_namespaced_operator_watches(render) -> None:
    """With operator.watchNamespace the operator reads nothing outside that namespace: the
    chart's ModelServer must go there (and helm test call it there), not into the release's."""
    values = {"operator": {"watchNamespace": "team-a"}, "modelServer": FULL["modelServer"]}
    objs = render(values, namespace="ops")
    (role,) = by_kind(objs, "Role")
    (ms,) = by_kind(objs, "ModelServer")
    assert ms["metadata"]["namespace"] == role["metadata"]["namespace"] == "team-a"
    (pod,) = by_kind(objs, "Pod")
    assert pod["spec"]["containers"][0]["args"][-1] == "http://qwen.team-a.svc:8000/v1/models"
    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render(values, name="demo", namespace="ops")["minisgl/templates/NOTES.txt"]
    assert "kubectl -n team-a get modelserver qwen" in notes
    assert "http://qwen.team-a.svc:8000" in notes


def test_notes_tell_how_to_reach_the_endpoint() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render(FULL, name="demo", namespace="llm")["minisgl/templates/NOTES.txt"]
        assert "port-forward svc/qwen 8000:8000" in notes
        assert "https://qwen.example.com" in notes
        bare = chart.render({}, name="demo", namespace="llm")["minisgl/templates/NOTES.txt"]
        assert "kubectl apply -f examples/modelserver.yaml" in bare


@pytest.mark.parametrize(
    "bad",
    [
        {"operator": {"image": {"pullPolicy": "Sometimes"}}},
        {"operator": {"prometheusUrl": "prometheus:9090"}},
        {"monitoring": {"podMonitor": {"interval": "often"}}},
        {"modelServer": {"name": "Not_A_Name"}},
        {"unknownKey": 1},
        # modelServer.spec is checked against the CRD's schema: Helm would apply a misspelt
        # field, and the API server would prune it without a word.
        {"modelServer": {"spec": {"model": "m", "replica": 2}}},
        {"modelServer": {"spec": {"model": "m", "engine": {"tensorParalelSize": 2}}}},
        {"modelServer": {"spec": {"model": "m", "autoscaling": {"maxReplicas": 2, "min": 1}}}},
        {"modelServer": {"spec": {"model": "m", "engine": {"dtype": "int4"}}}},
        {"modelServer": {"spec": {"model": "m", "resources": {"cpu": "lots"}}}},
        {"modelServer": {"spec": {"model": "m", "replicas": "two"}}},
        {"modelServer": {"spec": {"model": ""}}},
    ],
)
def test_values_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)


def test_values_schema_checks_model_server_spec_by_the_crds_own_schema() -> None:
    """One source: the values schema's modelServer.spec is rendered from the CRD's spec schema
    (`python -m minisgl_operator.crd --write` writes both), and every example's spec passes."""
    from minisgl_operator import crd

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["modelServer"]["properties"]["spec"] == {
        "$ref": f"#/definitions/{crd.VALUES_SPEC_DEFINITION}"
    }
    assert schema["definitions"][crd.VALUES_SPEC_DEFINITION] == crd.values_spec_schema()
    assert (CHART / "values.schema.json").read_text() == crd.render_values_schema(), (
        "the chart's values schema is stale: run `python -m minisgl_operator.crd --write`"
    )
    examples = sorted((ROOT / "examples").glob("modelserver*.yaml"))
    assert examples
    with helm.Chart.load(str(CHART)) as chart:
        for path in examples:
            spec_ = yaml.safe_load(path.read_text())["spec"]
            chart.validate_schema({"modelServer": {"enabled": True, "spec": spec_}})
        numbers = {"model": "m", "replicas": 2, "resources": {"cpu": 0.5, "memory": 1024}}
        chart.validate_schema({"modelServer": {"spec": numbers}})


def test_invalid_modelserver_values_fail_to_render() -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError):
        chart.render({"modelServer": {"enabled": True, "spec": {"model": ""}}}, name="demo")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool not installed; CI installs it (scripts/install.sh)")
        pytest.skip("promtool not installed (Debian package 'prometheus'; scripts/install.sh)")
    return path


def _series_labels(podmonitor: dict[str, Any], pod_labels: dict[str, str]) -> dict[str, str]:
    """The target labels the Prometheus Operator gives a pod's series: podTargetLabels copied
    with their names sanitized as Prometheus does (the rest: namespace, pod)."""
    return {
        re.sub(r"[^a-zA-Z0-9_]", "_", k): pod_labels[k]
        for k in podmonitor["spec"].get("podTargetLabels", [])
        if k in pod_labels
    }


def test_two_modelservers_serving_one_model_name_scale_on_their_own_pods(
    render, tmp_path: Path
) -> None:
    """Two ModelServers of one namespace serve model name "qwen": each one's KEDA triggers and
    status must read its own pods' series, as the chart's monitors label them. Evaluated by
    promtool on the series those pods would export."""
    objs = render(FULL)
    (pm,) = by_kind(objs, "PodMonitor")
    (sm,) = by_kind(objs, "ServiceMonitor")
    assert sm["spec"].get("podTargetLabels") == pm["spec"].get("podTargetLabels")
    ttft, waiting = queries.TTFT_HISTOGRAM, queries.WAITING_GAUGE
    # "a" answers every first token within 0.1 s, "b" within (0.5, 1] s; 3 and 5 waiting.
    shapes = {"a": ({"0.1": 10, "1": 10, "+Inf": 10}, 3), "b": ({"0.1": 0, "1": 10, "+Inf": 10}, 5)}
    series = []
    for name, (buckets, queued) in shapes.items():
        owner = {"metadata": {"name": name, "namespace": "llm", "uid": name}}
        owner["spec"] = {"model": "m", "servedModelName": "qwen"}
        (deploy,) = [c for c in plan(owner, Cluster()).apply if c["kind"] == "Deployment"]
        labels = {
            "namespace": "llm",
            "pod": f"{name}-7d4b9c-x2x5q",
            "model_name": "qwen",
            **_series_labels(pm, deploy["spec"]["template"]["metadata"]["labels"]),
        }
        text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        series += [
            {"series": f'{ttft}_bucket{{{text},le="{le}"}}', "values": f"0+{n}x16"}
            for le, n in buckets.items()
        ]
        series.append({"series": f"{waiting}{{{text}}}", "values": f"{queued}x16"})
    # a: p95 interpolates to 0.095 s within (0, 0.1]; b: to 0.955 s within (0.1, 1].
    expected = {"a": (0.095, 3), "b": (0.955, 5)}
    tests = []
    for name, (p95, queued) in expected.items():
        owner = {"metadata": {"name": name, "namespace": "llm", "uid": name}}
        owner["spec"] = {
            "model": "m",
            "servedModelName": "qwen",
            "autoscaling": {"maxReplicas": 3, "targets": {"ttftP95Seconds": 0.5}},
        }
        (so,) = [
            c for c in plan(owner, Cluster(**KEDA_CLUSTER)).apply if c["kind"] == "ScaledObject"
        ]
        (trigger,) = so["spec"]["triggers"]
        ms_spec = parse_spec(name, "llm", owner["spec"])
        for expr, value in (
            (trigger["metadata"]["query"], p95),
            (queries.waiting_total(ms_spec.namespace, ms_spec.name), queued),
        ):
            tests.append(
                {"expr": expr, "eval_time": "3m", "exp_samples": [{"labels": "{}", "value": value}]}
            )
    unit = {
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": tests}],
    }
    path = tmp_path / "slo_test.yaml"
    path.write_text(yaml.safe_dump(unit))
    result = subprocess.run(
        [_promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rbac_attributes_resolve_requests_as_the_api_server_does() -> None:
    from k8s_cluster import rbac_attributes

    ms = "/apis/minisgl.io/v1alpha1"
    assert rbac_attributes("GET", f"{ms}/modelservers", "watch=true&x=1", 200) == [
        ("minisgl.io", "modelservers", "watch")
    ]
    assert rbac_attributes("GET", f"{ms}/namespaces/a/modelservers", "", 200) == [
        ("minisgl.io", "modelservers", "list")
    ]
    assert rbac_attributes("PATCH", f"{ms}/namespaces/a/modelservers/q/status", "", 200) == [
        ("minisgl.io", "modelservers/status", "patch")
    ]
    assert rbac_attributes("PATCH", "/api/v1/namespaces/a/services/q", "force=true", 201) == [
        ("", "services", "patch"),
        ("", "services", "create"),
    ]
    assert rbac_attributes("POST", "/api/v1/namespaces/a/events", "", 201) == [
        ("", "events", "create")
    ]
    assert rbac_attributes("GET", "/api/v1/namespaces/a", "", 200) == [("", "namespaces", "get")]
    assert rbac_attributes("DELETE", "/apis/apps/v1/namespaces/a/deployments/q", "", 200) == [
        ("apps", "deployments", "delete")
    ]
    for discovery in ("/api", "/apis", "/apis/apps", "/apis/apps/v1", "/version", "/api/v1"):
        assert rbac_attributes("GET", discovery, "", 200) == [], discovery
