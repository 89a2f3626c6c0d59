"""The quantized-checkpoint tests' source checkpoints (80-160 MB each) leave with the process
that wrote them: left behind, run after run, they once filled the disk under CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_source_checkpoints_are_removed_when_the_process_ends(tmp_path: Path) -> None:
    code = "import quant_parity; print(quant_parity.source('tiny'))"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(HERE)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    written = Path(out.stdout.strip().splitlines()[-1])
    assert written.is_relative_to(tmp_path), written
    assert list(tmp_path.iterdir()) == []
