"""scripts/install.sh picks the torch build that fits the machine, says why, and never
installs system packages silently. Sourced with fake commands on PATH: nothing is installed
or downloaded."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _bin(tmp_path: Path, fakes: dict[str, str]) -> Path:
    """A PATH directory with the few real tools the functions use, plus fake commands."""
    d = tmp_path / "bin"
    d.mkdir()
    for tool in ("grep", "ls", "head", "tr", "cat"):
        real = shutil.which(tool)
        assert real is not None
        (d / tool).symlink_to(real)
    for name, body in fakes.items():
        (d / name).write_text("#!/bin/sh\n" + body + "\n")
        (d / name).chmod(0o755)
    return d


def _run(
    tmp_path: Path, snippet: str, fakes: dict[str, str], **env: str
) -> subprocess.CompletedProcess[str]:
    path = _bin(tmp_path, fakes)
    bash = shutil.which("bash")
    assert bash is not None
    full_env = {
        "PATH": str(path),
        "MINISGL_NVIDIA_PROC_DIR": str(tmp_path / "no-driver"),
        "HOME": str(tmp_path),
        **env,
    }
    return subprocess.run(
        [bash, "-c", f"source {SCRIPT} && {snippet}"],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
    )


def _choice(tmp_path: Path, fakes: dict[str, str], **env: str) -> tuple[str, list[str], str]:
    done = _run(tmp_path, 'c="$(torch_choice)" && echo "$c" && torch_pip_args "$c"', fakes, **env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    return lines[0], lines[1:], done.stderr


GPU_SMI = 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"'
BROKEN_SMI = (
    'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9'
)


def test_gpu_machine_gets_the_default_cuda_build(tmp_path: Path) -> None:
    choice, args, why = _choice(tmp_path, {"nvidia-smi": GPU_SMI})
    assert choice == "cuda" and args == ["torch==2.13.0"]
    assert "CUDA build" in why and "NVIDIA H100" in why


def test_driver_without_nvidia_smi_still_counts_as_gpu(tmp_path: Path) -> None:
    gpus = tmp_path / "driver" / "gpus" / "0000:01:00.0"
    gpus.mkdir(parents=True)
    choice, args, why = _choice(tmp_path, {}, MINISGL_NVIDIA_PROC_DIR=str(tmp_path / "driver"))
    assert choice == "cuda" and args == ["torch==2.13.0"] and "gpus" in why


REACHABLE = {"python3": "cat >/dev/null; exit 0"}  # the CPU index probe answers
UNREACHABLE = {"python3": "cat >/dev/null; exit 1"}


@pytest.mark.parametrize("smi", [{}, {"nvidia-smi": BROKEN_SMI}], ids=["no-smi", "no-driver"])
def test_machine_without_gpu_gets_the_cpu_build(tmp_path: Path, smi: dict[str, str]) -> None:
    choice, args, why = _choice(tmp_path, {**smi, **REACHABLE})
    assert choice == "cpu"
    # An extra index (not --index-url): pip's own configuration and PyPI still serve the rest.
    assert args == ["torch==2.13.0", "--extra-index-url", CPU_INDEX]
    assert "CPU build" in why and "MINISGL_TORCH=cuda" in why


def test_unreachable_cpu_index_never_falls_back_to_the_cuda_build(tmp_path: Path) -> None:
    choice, args, why = _choice(tmp_path, UNREACHABLE)
    assert choice == "cpu" and args == ["torch==2.13.0+cpu"]
    assert "unreachable" in why


def test_the_user_overrides_the_choice(tmp_path: Path) -> None:
    choice, args, why = _choice(tmp_path, {"nvidia-smi": GPU_SMI, **REACHABLE}, MINISGL_TORCH="cpu")
    assert choice == "cpu" and CPU_INDEX in args and "MINISGL_TORCH=cpu" in why
    (tmp_path / "again").mkdir()
    choice, args, _ = _choice(tmp_path / "again", {}, MINISGL_TORCH="cuda")
    assert choice == "cuda" and args == ["torch==2.13.0"]
    (tmp_path / "bad").mkdir()
    done = _run(tmp_path / "bad", "torch_choice", {}, MINISGL_TORCH="rocm")
    assert done.returncode != 0 and "MINISGL_TORCH must be cpu, cuda or auto" in done.stderr


def _apt_fakes(tmp_path: Path) -> dict[str, str]:
    log = tmp_path / "apt.log"
    return {"apt-get": f'echo "$@" >> {log}', "id": "echo 0"}


def test_apt_packages_are_announced_before_they_are_installed(tmp_path: Path) -> None:
    done = _run(tmp_path, "install_apt_packages", _apt_fakes(tmp_path))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Installing Debian packages with apt-get (set MINISGL_NO_APT=1 to skip)" in out
    assert "- prometheus: " in out and "- chromium: a headless browser" in out
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls == ["update -qq", "install -y -qq prometheus", "install -y -qq chromium"]


def test_a_package_the_distribution_lacks_does_not_stop_the_others(tmp_path: Path) -> None:
    log = tmp_path / "apt.log"
    apt = (
        f'echo "$@" >> {log}\n'
        'case "$*" in *"install -y -qq prometheus"*)\n'
        '  echo "E: Unable to locate package prometheus" >&2; exit 100;;\nesac'
    )
    done = _run(tmp_path, "install_apt_packages", {"apt-get": apt, "id": "echo 0"})
    assert done.returncode == 0, done.stderr
    assert "install -y -qq chromium" in log.read_text().splitlines()
    assert "could not install prometheus" in done.stderr
    assert "Not installed: prometheus" in done.stdout and "chromium" not in done.stderr


def test_no_apt_skips_system_packages(tmp_path: Path) -> None:
    done = _run(tmp_path, "install_apt_packages", _apt_fakes(tmp_path), MINISGL_NO_APT="1")
    assert done.returncode == 0, done.stderr
    assert "MINISGL_NO_APT is set: not installing prometheus chromium" in done.stdout
    assert not (tmp_path / "apt.log").exists()


def test_sourcing_installs_nothing(tmp_path: Path) -> None:
    done = _run(tmp_path, "true", _apt_fakes(tmp_path))
    assert done.returncode == 0 and done.stdout == "" and not (tmp_path / "apt.log").exists()
    assert not (tmp_path / ".venv").exists()


def _real_python() -> str:
    """This interpreter's own binary (not the venv's launcher), to wrap in a fake python3."""
    return os.path.realpath(sys.executable)


def test_python_check_passes_a_python_that_can_make_a_venv(tmp_path: Path) -> None:
    done = _run(tmp_path, "check_python", {"python3": f'exec {_real_python()} "$@"'})
    assert done.returncode == 0, done.stderr
    assert f"python3 {sys.version_info[0]}.{sys.version_info[1]} " in done.stdout


def test_python_without_ensurepip_is_told_to_install_python3_venv(tmp_path: Path) -> None:
    # Debian/Ubuntu without python3-venv: the stdlib's ensurepip is missing.
    shadow = tmp_path / "shadow" / "ensurepip"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'ensurepip'\")\n")
    fake = f'PYTHONPATH={shadow.parent} exec {_real_python()} "$@"'
    done = _run(tmp_path, "check_python", {"python3": fake})
    assert done.returncode == 1
    assert "apt-get install python3-venv" in done.stderr, done.stderr
    assert "cannot create a virtual environment" in done.stderr


def test_old_python_is_named_with_the_version_needed(tmp_path: Path) -> None:
    done = _run(tmp_path, "check_python", {"python3": OLD_PYTHON})
    assert done.returncode == 1
    assert "Python >= 3.10 needed, found 3.8" in done.stderr, done.stderr


def test_missing_python3_says_what_to_install(tmp_path: Path) -> None:
    done = _run(tmp_path, "check_python", {})
    assert done.returncode == 1 and "python3 not found" in done.stderr, done.stderr


OLD_PYTHON = "cat >/dev/null; echo 3.8; echo venv"  # answers the check's script as 3.8 would


def test_install_stops_before_making_anything_when_python_is_unfit(tmp_path: Path) -> None:
    """Run as a script (set -e, as users and CI run it) from a scratch copy: the check comes
    first, so nothing is created and the one message is the check's."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "install.sh")
    bash = shutil.which("bash")
    assert bash is not None
    path = _bin(tmp_path, {"python3": OLD_PYTHON})
    done = subprocess.run(
        [bash, str(tmp_path / "scripts" / "install.sh")],
        capture_output=True,
        text=True,
        env={"PATH": str(path), "HOME": str(tmp_path)},
        timeout=60,
    )
    assert done.returncode != 0
    assert "Python >= 3.10 needed, found 3.8" in done.stderr, done.stderr
    assert not (tmp_path / ".venv").exists() and "pip install" not in done.stdout


def test_minimum_python_matches_pyproject() -> None:
    pyproject = (SCRIPT.parents[1] / "pyproject.toml").read_text()
    wanted = re.search(r'^requires-python = ">=([0-9.]+)"$', pyproject, re.M)
    assert wanted is not None
    assert f"MIN_PYTHON={wanted[1]} " in SCRIPT.read_text()
