"""benchmarks/gpu_check.py runs its CPU-safe parts on the CPU and says what it skipped, and why."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


def test_gpu_check_runs_its_cpu_parts_and_names_the_skipped(
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    import_benchmark: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_check = import_benchmark("gpu_check")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    assert gpu_check.main(["--quick", "--model", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "PASS parity[torch]: " in out  # greedy tokens equal transformers'
    assert "PASS long[torch]: " in out  # the long prompt, chunked
    assert "PASS kv-fp8[torch]: " in out  # an fp8 KV cache against a rounding transformers
    assert "PASS served: " in out  # python -m minisgl, its requests, a clean exit
    # Published quantized layouts (dense FP8 blocks, a MoE in GPTQ-Int4) against transformers
    # on their dequantized twins, in chunks and again from the prefix cache
    for case in ("fp8 block", "moe gptq int4"):
        assert f"PASS quant[{case}]: " in out
    for check in ("backends", "graphs"):
        assert f"SKIP {check}: needs CUDA" in out
    for check in ("decode", "8 x 16"):
        assert f"SKIP {check}: figures of a GPU" in out
    assert "0 failed" in out
    assert not list(tmp_path.glob("gpu-check-*"))  # the served log kept only on a failure


def test_a_clear_divergence_fails_and_a_near_tie_does_not(
    import_benchmark: Callable[[str], ModuleType],
) -> None:
    gpu_check = import_benchmark("gpu_check")
    Run, compare = gpu_check.Run, gpu_check.compare

    ref = Run([[5, 6, 7, 8]], [[2.0, 2.0, 0.01, 2.0]])
    assert compare(ref, [[5, 6, 9, 9]], 0.05, "x").startswith("2/4")  # after the near-tie
    # A near-tie broken the same way: the runs are still alike, the comparison goes on.
    assert compare(ref, [[5, 6, 7, 8]], 0.05, "x").startswith("4/4")
    with pytest.raises(AssertionError, match="diverged at step 1"):
        compare(ref, [[5, 9, 7, 8]], 0.05, "x")
    with pytest.raises(AssertionError, match="clear of near-ties"):
        compare(Run([[5, 6]], [[0.0, 3.0]]), [[4, 4]], 0.05, "x")
