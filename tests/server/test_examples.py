"""The user-facing example runs offline, end to end, and says what it measured."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_stage3_milestone_runs_offline() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "stage3_milestone.py")],
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert re.search(r"8 concurrent x 16 tokens: [\d.]+ s, [\d.]+ tokens/s, TTFT median", out)
    assert "curl http://127.0.0.1:" in out
    assert re.search(r"server pid \d+: 3 worker processes", out)
    assert "server exited with code 0" in out


def test_serving_doc_answers_the_three_questions() -> None:
    doc = (ROOT / "docs" / "serving.md").read_text()
    assert "```" in doc  # the diagram
    for topic in ("tokeniz", "serializ"):
        assert topic in doc.lower()
