"""Quantized CPU weights are streamed by every decode step as float ones are: the start-up that
picks their kernels puts their codes (and scales, zero points) on huge pages first, in place,
with the same values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl.layers import cpu_kernels
from minisgl.quant import loading
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme
from minisgl.quant.weight import QuantWeight
from minisgl.testing.smaps import huge_kb_under, thp_mode


def test_prepare_cpu_moves_codes_onto_huge_pages(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    n, k = 4096, 1024  # 4 MiB of int8 codes: two huge pages
    q = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), load_scheme("int8"))
    w = QuantWeight(n, k, bits=8, fp8=False, group_size=0, groups=1, scattered_groups=False)
    w.codes.copy_(q.codes)
    w.scales.copy_(q.scales)
    if w.zeros is not None:
        w.zeros.copy_(q.zeros if q.zeros is not None else torch.zeros_like(w.zeros))
    codes, before = w.codes, w.codes.data_ptr()
    values = codes.clone()
    loading.prepare_cpu(torch.nn.ModuleList([w]), torch.bfloat16, "off")
    assert w.codes is codes and torch.equal(codes, values) and codes.data_ptr() != before
    if thp_mode() in ("always", "madvise"):
        assert huge_kb_under(codes.data_ptr() + codes.numel() // 2) >= 2048
    if cpu_kernels.load() is not None:
        assert w.kernel is not None
        x = torch.randn(3, k).bfloat16()
        assert torch.equal(w.kernel(x, w.view()), w.kernel(x, w.view()))
