"""The packed panels' AMX forms beside vnni_panel: amx_vpanel (qvpanel.c's va_matmul) multiplies
them on AMX-INT8 tiles, to the bit what vnni_panel gives (so a weight takes either per row
count); amx_bf16_vpanel (qamx.c over the packed layout) dequantizes them to bf16 for many rows,
to the bit what amx_panel gives on the row-major codes. And the chooser's use of them: offered
only beside vnni_panel where their kernels run, the packed layout's kernel per bucket wherever
one was the fastest of them, the weights packed for any mix. Where the build or CPU has no
AMX-INT8 (amx_bf16_vpanel: neither AMX nor AVX512-BF16) the entry points are absent and the
chooser never offers them: checked too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from minisgl.layers import cpu_kernels, kernel_choice
from minisgl.quant import cpu_choice, cpu_panel, cpu_vpanel
from minisgl.testing.qtensors import random_qtensor
from minisgl.testing.threads import at_thread_counts


def _has_tiles() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.qvpanel_amx)


def _has_bf16_panel() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.qamx_packed)


needs_tiles = pytest.mark.skipif(
    not _has_tiles(), reason="no AMX-INT8 here (the chooser never offers it: below)"
)
needs_bf16_panel = pytest.mark.skipif(
    not _has_bf16_panel(), reason="no AMX or AVX512-BF16 here (the chooser never offers it)"
)
# (bits, group, K): 8-bit per channel (sums folded every 256 features: 4 tile steps), 8-bit
# groups of 32 (half steps of 32 features), 4-bit groups of 128 / 64 / 32, 4-bit per channel
# over K = 3072 (one int32 sum per 1024 features).
FORMATS = [(8, 0, 1024), (8, 32, 512), (4, 128, 512), (4, 64, 512), (4, 32, 512), (4, 0, 3072)]
ROWS = [0, 1, 2, 7, 16, 17, 40, 64]  # 0: a step's empty LM head call


@pytest.fixture(params=["int16", "int8"])
def activations(request: pytest.FixtureRequest) -> Iterator[str]:
    """--cpu-quantized-activations for the test (int16: exact x; int8: x rounded to 8 bits
    per block of features), restored after it."""
    cpu_kernels.set_quantized_activations(request.param)
    try:
        yield request.param
    finally:
        cpu_kernels.set_quantized_activations("int16")


@needs_tiles
@pytest.mark.parametrize(("bits", "group", "k"), FORMATS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_the_tiles_give_vnni_panels_bits(
    bits: int, group: int, k: int, x_dtype: torch.dtype, activations: str
) -> None:
    """Every row count (one m-tile, a partial one, several), bf16 and fp32 x and output, rows
    of x far apart in size, exact x and x in 8 bits: the same bits as vnni_panel on the same
    panels."""
    w = cpu_vpanel.pack(random_qtensor(96, k, bits, group, seed=bits + group))
    for m in ROWS:
        x = torch.randn(m, k) * torch.logspace(-3, 3, m)[:, None]
        x = x.to(x_dtype)
        for out in (torch.float32, torch.bfloat16):
            want = cpu_vpanel.vnni_panel(x, w, out)
            assert torch.equal(cpu_vpanel.amx_vpanel(x, w, out), want), (m, out, activations)


@needs_tiles
def test_a_row_does_not_depend_on_the_threads_or_the_rows_beside_it() -> None:
    """Row results alone and in a batch of 33, at 1 and 2 threads: the same bits."""
    w = cpu_vpanel.pack(random_qtensor(128, 1024, 4, 128, seed=3))
    x = torch.randn(33, 1024, dtype=torch.bfloat16)
    outs = at_thread_counts(lambda: cpu_vpanel.amx_vpanel(x, w, torch.float32))
    assert all(torch.equal(y, outs[0]) for y in outs)
    assert torch.equal(cpu_vpanel.amx_vpanel(x[5:6], w, torch.float32), outs[0][5:6])


@needs_tiles
def test_x_in_8_bits_gives_vnni_panels_form_of_it() -> None:
    """Under --cpu-quantized-activations int8 vnni_panel rounds x to 8 bits; amx_vpanel's
    8-bit form then gives the same bits as vnni_panel's, not the exact product."""
    w = cpu_vpanel.pack(random_qtensor(64, 512, 4, 128, seed=5))
    x = torch.randn(9, 512, dtype=torch.bfloat16)
    exact = cpu_vpanel.amx_vpanel(x, w, torch.float32)
    cpu_kernels.set_quantized_activations("int8")
    try:
        rounded = cpu_vpanel.vnni_panel(x, w, torch.float32)
        got = cpu_vpanel.amx_vpanel(x, w, torch.float32)
    finally:
        cpu_kernels.set_quantized_activations("int16")
    assert not torch.equal(rounded, exact)
    assert torch.equal(got, rounded)


@needs_bf16_panel
@pytest.mark.parametrize(("bits", "group", "k"), FORMATS)
def test_the_bf16_panels_give_amx_panels_bits(bits: int, group: int, k: int) -> None:
    """Dequantized to bf16 out of the packed layout: the row-major codes' amx_panel to the
    bit, at every row count; fp32 x (which that kernel does not take) runs vnni_panel."""
    w = random_qtensor(96, k, bits, group, seed=bits + group)
    packed = cpu_vpanel.pack(w)
    for m in ROWS:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        for out in (torch.float32, torch.bfloat16):
            want = cpu_panel.amx_panel(x, w, out)
            assert torch.equal(cpu_vpanel.amx_bf16_vpanel(x, packed, out), want), (m, out)
    x = torch.randn(5, k)
    want = cpu_vpanel.vnni_panel(x, packed, torch.float32)
    assert torch.equal(cpu_vpanel.amx_bf16_vpanel(x, packed, torch.float32), want)


def test_offered_only_beside_vnni_panel_where_the_tiles_run() -> None:
    """Not for weights that may not be repacked, nor for fp32 x (amx_bf16_vpanel); elsewhere,
    under exact and 8-bit x alike (amx_vpanel), exactly where the build and CPU have their
    kernels (and vnni_panel takes the weight)."""
    w = random_qtensor(64, 512, 8, 0)
    assert not {"amx_vpanel", "amx_bf16_vpanel"} & set(cpu_choice.offered([w]))
    packed = cpu_choice.offered([w], packable=True)
    assert ("amx_vpanel" in packed) == (_has_tiles() and cpu_choice.PACKED in packed)
    assert ("amx_bf16_vpanel" in packed) == (_has_bf16_panel() and cpu_choice.PACKED in packed)
    assert "amx_bf16_vpanel" not in cpu_choice.offered([w], True, torch.float32)
    cpu_kernels.set_quantized_activations("int8")
    try:
        under_x8 = cpu_choice.offered([w], packable=True)
    finally:
        cpu_kernels.set_quantized_activations("int16")
    assert ("amx_vpanel" in under_x8) == ("amx_vpanel" in packed)


def test_the_layout_takes_the_faster_of_its_two_kernels_per_bucket() -> None:
    """Packed, each bucket runs whichever of vnni_panel and amx_vpanel was faster there (the
    same bits), vnni_panel where amx_vpanel did not run; the layout is taken or not on those
    picks' average, against the row-major picks."""
    n = len(kernel_choice.BUCKETS)
    defaults = ("qgemv",) * n
    vnni = [0.8] + [1.1] * (n - 1)
    tiles = [None, 0.9] + [0.6] * (n - 2)
    timings = {"qgemv": [1.0] * n, cpu_choice.PACKED: vnni, "amx_vpanel": tiles}
    want = (cpu_choice.PACKED, "amx_vpanel") + ("amx_vpanel",) * (n - 2)
    assert cpu_choice.one_layout(timings, defaults) == want
    # vnni_panel alone would lose (1.1x behind at most row counts): the tiles carry the layout
    assert cpu_choice.one_layout({"qgemv": [1.0] * n, cpu_choice.PACKED: vnni}, defaults) == (
        defaults
    )
    slow = {"qgemv": [1.0] * n, cpu_choice.PACKED: vnni, "amx_vpanel": [None] + [1.2] * (n - 1)}
    assert cpu_choice.one_layout(slow, defaults) == defaults


@needs_tiles
def test_a_mix_of_the_packed_kernels_runs_on_the_packed_weight() -> None:
    """A QuantKernel whose picks mix the two runs each on the packed weight (not on a timing
    copy), and the decode chain's C call for an amx_vpanel pick is the tiles' entry point."""
    w = random_qtensor(64, 512, 8, 0, seed=7)
    packed = cpu_vpanel.pack(w)
    n = len(kernel_choice.BUCKETS)
    kernel = cpu_choice.QuantKernel((cpu_choice.PACKED,) + ("amx_vpanel",) * (n - 1))
    for m in (1, 8):
        x = torch.randn(m, 512, dtype=torch.bfloat16)
        assert torch.equal(kernel(x, packed), cpu_vpanel.vnni_panel(x, packed))
    assert cpu_vpanel.held_copy(packed) is None
    lib = cpu_kernels.load()
    assert cpu_choice.kernel_fn(lib, "amx_vpanel", "u8", 1) is lib.qvpanel_amx["u8"]
    if _has_bf16_panel():  # fp32 x: vnni_panel's, as the wrapper runs it
        assert cpu_choice.kernel_fn(lib, "amx_bf16_vpanel", "u8", 1) is lib.qamx_packed["u8"]
        assert cpu_choice.kernel_fn(lib, "amx_bf16_vpanel", "u8", 0) is lib.qvpanel["u8"]
