"""A CPU step's freed temporaries stay with the process for the next step (minisgl/heap.py):
without that, glibc unmaps every allocation over 32 MiB at free, and the next step's page
faults (and the kernel's zeroing of every page) cost a prefill a large share of its time."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest
import torch

from minisgl import heap
from minisgl.config import EngineArgs
from minisgl.engine.model_runner import ModelRunner
from minisgl.models.config import ModelConfig

# Over glibc's largest mmap threshold (32 MiB), as a long prefill's logits or MLP products are.
_BIG = 64 << 20


def _faults_of_a_big_temporary() -> int:
    """Page faults of allocating, filling and freeing a _BIG tensor, the second time."""
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(_BIG // 4, dtype=torch.float32)
        t.fill_(1.0)
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) only")
def test_a_cpu_runner_keeps_what_its_steps_free(tiny_model_dir: Path) -> None:
    args = EngineArgs(
        model=str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        num_pages=16,
        page_size=4,
        cpu_kernel_tuning="off",
    )
    ModelRunner(args, tiny_model_dir, ModelConfig.from_dir(tiny_model_dir), 64)
    assert heap.keep_freed_memory()
    # Unmapped at free, the second pass would fault in all 16384 pages again.
    assert _faults_of_a_big_temporary() < _BIG // 4096 // 16
