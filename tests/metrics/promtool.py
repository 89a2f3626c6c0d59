"""Locating promtool/prometheus (Debian's `prometheus` package; scripts/install.sh installs it)."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RULES_FILE = REPO / "charts/minisgl/files/prometheus-rules.yaml"
DASHBOARD_DIR = REPO / "charts/minisgl/dashboards"


def binary(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        pytest.skip(f"{name} not installed (Debian package 'prometheus'; scripts/install.sh)")
    return path


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *map(str, args)], capture_output=True, text=True, timeout=60
    )
