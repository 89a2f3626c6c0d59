"""A tensor-parallel rank that dies during start-up: rank 0 raises with its error, no hang.

Before, rank 0 waited in torch.distributed's rendezvous for the dead rank for its whole
timeout (ten minutes), and a script run from stdin hung there forever-looking.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from minisgl import LLM
from minisgl.engine.tp_engine import TPRankError

pytestmark = pytest.mark.timeout(300)
DEADLINE_S = 120  # generous for a busy machine; the hang it replaces lasted 600 s


def test_script_from_stdin_raises_the_rank_error(tiny_model_dir, tmp_path):
    script = textwrap.dedent(
        f"""
        from minisgl import LLM
        LLM({str(tiny_model_dir)!r}, dtype="float32", num_pages=64, tp_size=2)
        print("started")
        """
    )
    done = subprocess.run(
        [sys.executable, "-"],
        input=script,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=DEADLINE_S,
    )
    assert done.returncode != 0 and "started" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("minisgl.engine.tp_engine.TPRankError: tensor-parallel rank 1"), last
    assert "<stdin>" in last and "__main__" in last, last


def test_rank_error_reaches_the_caller(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MINISGL_TP_SUBSCRIBE_DELAY_S", "not-a-number")  # fails in rank 1 only
    before = _ranks()
    with pytest.raises(TPRankError, match="rank 1 failed during start-up: ValueError"):
        LLM(str(tiny_model_dir), dtype="float32", num_pages=64, tp_size=2)
    assert not _ranks() - before, "a rank outlived the failure"


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_rank_that_fails_joining_the_group_is_reported_at_once(tiny_model_dir, monkeypatch, how):
    """Rank 1 checks in, then fails inside torch.distributed's rendezvous: before, rank 0 sat in
    that rendezvous, waiting for it, for the group's whole timeout (ten minutes)."""
    hook = Path(__file__).parent / "tp_join_hook"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MINISGL_TEST_JOIN_FAILURE", how)
    before, start = _ranks(), time.monotonic()
    expected = "could not join the group" if how == "raise" else "rank 1 .*exited with code 3"
    with pytest.raises(TPRankError, match=expected):
        LLM(str(tiny_model_dir), dtype="float32", num_pages=64, tp_size=2)
    assert time.monotonic() - start < DEADLINE_S
    assert not _ranks() - before, "a rank outlived the failure"


def _ranks() -> set[int]:
    """Child processes, less multiprocessing's resource tracker (a helper that stays)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                p.cmdline()
            ):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out
