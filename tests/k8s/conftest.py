"""Fixtures for the Kubernetes tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from k8s_cluster import UPSTREAM_CRDS, Api, connect, install_upstream_crds
from k8s_support import CHART


@pytest.fixture(scope="session")
def render() -> Callable[..., list[dict[str, Any]]]:
    """Render the chart with real Helm (helm-python-sdk) -> parsed objects."""
    import helm_python as helm

    chart = helm.Chart.load(str(CHART))

    def _render(values: dict[str, Any] | None = None, namespace: str = "llm") -> list[dict]:
        out = chart.render(values or {}, name="demo", namespace=namespace, is_install=True)
        objs = []
        for path, text in sorted(out.items()):
            if path.endswith("NOTES.txt"):
                continue
            objs += [d for d in yaml.safe_load_all(text) if d]
        return objs

    return _render


def _unavailable(reason: str) -> None:
    # In CI a skipped cluster test hides exactly what only a real API server catches (a CRD it
    # rejects, a missing RBAC verb): there, no cluster is a failure.
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI runs the cluster suite (scripts/test.sh starts a control plane)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Api]:
    """Admin access to the cluster KUBECONFIG names (one per test session)."""
    api, reason = connect()
    if api is None:
        _unavailable(reason)
    assert api is not None
    try:
        yield api
    finally:
        api.close()


@pytest.fixture(scope="session")
def upstream_crds(cluster: Api) -> list[str]:
    """LeaderWorkerSet, Gateway API and InferencePool, unmodified from their projects."""
    if not any(UPSTREAM_CRDS.glob("*.yaml")):
        _unavailable(f"no upstream CRDs in {UPSTREAM_CRDS} (set MINISGL_K8S_CRDS)")
    return install_upstream_crds(cluster)
