"""The user-facing example runs offline, end to end, and says what it measured."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_stage3_milestone_runs_offline_keeps_serving_and_cleans_up() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-u", str(ROOT / "examples" / "stage3_milestone.py"), "--keep-serving"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "until Ctrl-C" in line:
                break
        out = "".join(lines)
        assert "until Ctrl-C" in out, out[-4000:]
        url = re.search(r"serving at (http://\S+) until Ctrl-C", out).group(1)  # type: ignore[union-attr]
        # Still up after the demo (it used to shut down right after printing the curl line).
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{url}/", timeout=10).status_code == 200  # the playground
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"8 concurrent x 16 tokens: [\d.]+ s, [\d.]+ tokens/s, TTFT median", out)
    assert "curl http://127.0.0.1:" in out
    assert re.search(r"server pid \d+: 3 worker processes", out)
    assert "server exited with code 0" in out
    model = re.search(r"fixture to (\S+)", out).group(1)  # type: ignore[union-attr]
    assert not Path(model).exists() and not Path(model).parent.exists(), "fixture left behind"


def test_serving_doc_answers_the_three_questions() -> None:
    doc = (ROOT / "docs" / "serving.md").read_text()
    assert "```" in doc  # the diagram
    for topic in ("tokeniz", "serializ"):
        assert topic in doc.lower()
