"""Fixtures for the Kubernetes tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml
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
