"""A CPU step's freed temporaries stay with the process for the next step (minisgl/heap.py):
without that, glibc unmaps every allocation over 32 MiB at free (a long prefill's logits and MLP
products are that large), and every repeated step faults all of their pages in again."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl import heap
from minisgl.config import EngineArgs
from minisgl.engine.model_runner import ForwardInput, ModelRunner
from minisgl.models.config import ModelConfig
from minisgl.sampling_params import SamplingParams

PAGE = 16
# 64 prompts of 256 tokens: the sampled rows' logits alone, 64 x the ~152k vocabulary in
# float32, are ~39 MB, over glibc's largest mmap threshold.
PROMPTS, LENGTH = 64, 256


def _prefill() -> ForwardInput:
    per = LENGTH // PAGE
    return ForwardInput(
        token_ids=[(31 * i + 7) % 1000 for i in range(PROMPTS * LENGTH)],
        prefix_lens=[0] * PROMPTS,
        extend_lens=[LENGTH] * PROMPTS,
        page_tables=[list(range(i * per, (i + 1) * per)) for i in range(PROMPTS)],
        sample_rows=list(range(PROMPTS)),
        sample_params=[SamplingParams(temperature=0)] * PROMPTS,
        sample_steps=[0] * PROMPTS,
        sample_seeds=[0] * PROMPTS,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux) only")
def test_repeated_cpu_prefill_steps_stop_faulting(tiny_model_dir: Path) -> None:
    args = EngineArgs(
        model=str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        num_pages=PROMPTS * LENGTH // PAGE + 8,
        page_size=PAGE,
        cpu_kernel_tuning="off",
    )
    runner = ModelRunner(args, tiny_model_dir, ModelConfig.from_dir(tiny_model_dir), LENGTH)
    assert heap.keep_freed_memory()
    inp = _prefill()
    faults = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        runner.forward(inp)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # The first steps grow the heap to what a step needs; from then on a step reuses it (the
    # least of the later steps: one may still find a hole too small for one of its buffers).
    # Unmapped at free, every step faults in its ~10k pages of logits and activations again.
    assert min(faults[2:]) < 500, faults


_HOLES = """
import ctypes, resource
import torch
from minisgl import heap

libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 256 << 20)  # M_MMAP_THRESHOLD: 4 MB blocks from the heap, as loading's are


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


blocks = [torch.ones(1 << 20) for _ in range(64)]  # 64 x 4 MB, touched
pin = torch.ones(1 << 20)  # above them: the heap's top is not free
del blocks
before = rss_mb()
assert heap.keep_freed_memory()
print(before - rss_mb())
"""


def test_memory_loading_freed_in_the_heap_goes_back_when_steps_start_keeping() -> None:
    """Blocks freed below the heap's top (weights moved onto huge pages, quantization
    temporaries) are handed back before the runner starts keeping what its steps free."""
    out = subprocess.run(
        [sys.executable, "-c", _HOLES], capture_output=True, text=True, check=True, timeout=120
    )
    assert float(out.stdout.split()[-1]) > 128, out.stdout  # of the 256 MB freed
