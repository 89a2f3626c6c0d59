"""scripts/test.sh (README "Test", .ci/run): pytest runs between the control plane's `up` and
`down`, with the KUBECONFIG `up` printed, and `down` runs when tests fail too."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_CONTROL_PLANE = """#!/usr/bin/env bash
echo "$1" >> "$(dirname "$0")/calls"
[ "$1" = up ] && echo "export KUBECONFIG=$(dirname "$0")/kubeconfig"
exit 0
"""

CHECK_ENV = """
import os
from pathlib import Path

def test_env():
    here = Path(os.environ["KUBECONFIG"]).parent
    assert (here / "calls").read_text() == "up\\n"  # up before the tests, down after
    assert os.environ["MINISGL_K8S_CRDS"] == str(here / "crds")
    assert os.environ.get("SHOULD_FAIL") != "1"
"""


def run_script(tmp_path: Path, fail: bool) -> tuple[subprocess.CompletedProcess[str], str]:
    plane = tmp_path / "plane"
    plane.mkdir(exist_ok=True)
    (plane / "calls").unlink(missing_ok=True)
    script = plane / "control-plane"
    script.write_text(FAKE_CONTROL_PLANE)
    script.chmod(0o755)
    test_file = tmp_path / "test_env.py"
    test_file.write_text(CHECK_ENV)
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "MINISGL_K8S_CRDS")}
    env.update(MINISGL_CONTROL_PLANE=str(script), SHOULD_FAIL="1" if fail else "0")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/test.sh"), str(test_file), "-q", "-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, (plane / "calls").read_text()


def test_pytest_runs_with_the_control_planes_kubeconfig_and_it_stops_after(tmp_path: Path) -> None:
    proc, calls = run_script(tmp_path, fail=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert calls == "up\ndown\n"


def test_the_control_plane_stops_when_tests_fail(tmp_path: Path) -> None:
    proc, calls = run_script(tmp_path, fail=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert calls == "up\ndown\n"


def test_ci_runs_the_readme_test_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Test\n\n```bash\n(.*?)\n```", readme, re.S)
    assert block is not None
    commands = [c.strip() for c in block.group(1).split("&&")]
    assert commands == ["bash scripts/install.sh", "bash scripts/test.sh"]
    ci = (ROOT / ".ci/run").read_text().splitlines()
    assert all(c in ci for c in commands)
