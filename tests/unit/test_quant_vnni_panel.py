"""vnni_panel (qvpanel.c): 8- and 4-bit integer codes repacked once into 32-row panels and
multiplied exactly (x quantized per row to int16, as the decode GEMV does) with AVX512-VNNI,
for any row count, or against x rounded to 8 bits as x8_panel rounds it; fp8 codes in panels
of their own against bf16 x. Checked against a float64 emulation of the same arithmetic (fp8:
a float64 product within fp32 rounding), for the independence of a row's result from the rows
beside it and the thread count, for the packed table's row lookups, and for the chooser's
all-or-nothing use of the layout and its timing passes. Where the build has no AVX512-VNNI
(fp8: AVX512-VBMI) the kernel is absent and the chooser never offers it: checked too."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from minisgl.layers import cpu_build, cpu_kernels, kernel_choice
from minisgl.quant import cpu_choice, cpu_panel, cpu_vpanel
from minisgl.quant.qtensor import QTensor, dequantize, take_rows
from minisgl.testing.flushes import Passes
from minisgl.testing.qtensors import random_qtensor
from minisgl.testing.switch_clock import measure_only, time_by_switch
from minisgl.testing.threads import at_thread_counts


def _emulate(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x quantized per row to int16 (scale max|x| / 32767 in fp32, x times its inverse,
    nearest even, clamped), integer sums per group exact (float64), zero points subtracted
    through the group's sum of x's codes, scaled by the group's and the row's scales."""
    m, k = x.shape
    gs = w.group_size or k
    xf = x.float()
    amax = xf.abs().amax(-1)
    s = torch.where(amax > 0, amax / 32767.0, torch.ones_like(amax))
    q = torch.round(xf * (1.0 / s)[:, None]).clamp(-32767, 32767).double()
    codes = torch.stack([w.codes & 15, w.codes >> 4], -1).flatten(1) if w.bits == 4 else w.codes
    qg = q.view(m, k // gs, gs)
    acc = torch.einsum("mgk,ngk->mng", qg, codes.double().view(-1, k // gs, gs))
    t = acc - w.zeros.double()[None] * qg.sum(-1)[:, None, :]
    return (t * w.scales.double()[None]).sum(-1) * s.double()[:, None]


def _has_kernel() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.qvpanel)


def _has_fp8_kernel() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and "fp8" in lib.qvpanel


needs_kernel = pytest.mark.skipif(
    not _has_kernel(), reason="no AVX512-VNNI build here (the chooser never offers it: below)"
)
# (bits, group, K): 8-bit per channel (sums folded every 256 features), 8-bit groups (of 16:
# GGUF's Q6_K), 4-bit groups of 128 / 64 / 32, and 4-bit per channel over K = 3072 (folded
# every 1024).
FORMATS = [
    (8, 0, 1024),
    (8, 64, 512),
    (8, 16, 512),
    (4, 128, 512),
    (4, 64, 512),
    (4, 32, 512),
    (4, 0, 3072),
]


@needs_kernel
@pytest.mark.parametrize("bits,group,k", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_the_int16_emulation_at_one_and_two_threads(
    bits: int, group: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    w = random_qtensor(96, k, bits, group)  # three panels
    packed = cpu_vpanel.pack(w)
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 4).to(dtype)
    outs = at_thread_counts(lambda: cpu_vpanel.vnni_panel(x, packed, torch.float32))
    ref = _emulate(x, w)
    tol = 2e-6 * ref.abs().amax().item()
    for y in outs:
        assert (y.double() - ref).abs().max().item() <= tol
    assert torch.equal(outs[0], outs[1])  # a row's sums do not depend on the thread count


@needs_kernel
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16), (8, 0)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("zero", [0, 1, "top"])
@pytest.mark.parametrize("x8", [False, True])
def test_panels_of_one_zero_point_take_it_once(
    bits: int, group: int, rows: int, zero: int | str, x8: bool
) -> None:
    """A panel whose zero points are all one value (0: GGUF's K-quants; Q6_K's 32, Q8_0's
    128) subtracts it without a multiply per lane, or skips the term at 0, x in 16 bits or 8:
    panel 0 all that value, panel 1 random, panel 2 that value but in one group of one row,
    each row the emulation's (x8_panel's bits where it takes the weight); and panel 2's other
    rows have the bits they have where that row's value is the panel's too (the one value's
    path against the lanes' multiply)."""
    value = 2**bits - 1 if zero == "top" else int(zero)
    w = random_qtensor(96, 512, bits, group, seed=2)
    w.zeros[:32] = value
    w.zeros[64:] = value
    x = (torch.randn(rows, 512) * 4).to(torch.bfloat16)
    cpu_kernels.set_quantized_activations("int8" if x8 else "int16")
    try:
        uniform = cpu_vpanel.vnni_panel(x, cpu_vpanel.pack(w), torch.float32)
        w.zeros[95, -1] = 2**bits - 1 - value
        y = cpu_vpanel.vnni_panel(x, cpu_vpanel.pack(w), torch.float32)
        want = cpu_panel.x8_panel(x, w, torch.float32) if x8 and group != 16 else None
    finally:
        cpu_kernels.set_quantized_activations("int16")
    if want is not None:
        assert torch.equal(y, want)
    else:
        ref = (_emulate_x8 if x8 else _emulate)(x, w)
        assert (y.double() - ref).abs().max().item() <= 2e-6 * ref.abs().amax().item()
    assert torch.equal(y[:, :95], uniform[:, :95])


@needs_kernel
@pytest.mark.parametrize("bits,group", [(4, 128), (8, 0), (8, 128)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(bits: int, group: int) -> None:
    """Each row of a 19-row call (tiles of 8, 8 and 3) equals that row alone (the one-row
    loop: 4-bit codes against x's bytes, more sums in flight), bit for bit, and bf16 out is
    the fp32 result rounded once; against the exact matmul on the dequantized weight, int16
    x's error (~1e-5)."""
    w = random_qtensor(64, 1024, bits, group, seed=1)
    packed = cpu_vpanel.pack(w)
    x = torch.randn(19, 1024).to(torch.bfloat16)
    y = cpu_vpanel.vnni_panel(x, packed, torch.float32)
    for i in (0, 7, 8, 16, 18):
        assert torch.equal(cpu_vpanel.vnni_panel(x[i : i + 1], packed, torch.float32)[0], y[i])
    assert torch.equal(cpu_vpanel.vnni_panel(x, packed), y.to(torch.bfloat16))
    exact = x.double() @ dequantize(w, torch.float32).double().T
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-4


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_lookups_in_a_packed_table_equal_the_row_major_ones(bits: int) -> None:
    """A tied table packed for its LM head: its rows, gathered by torch (prefill) or by C (a
    decode step's few), are the row-major table's dequantized rows exactly."""
    w = random_qtensor(96, 256, bits, 128, seed=2)
    packed = cpu_vpanel.pack(w)
    ids = [0, 31, 32, 95, 40]
    want = dequantize(take_rows(w, torch.tensor(ids)), torch.float32)
    assert torch.equal(cpu_vpanel.dequant_rows(packed, ids), want)
    assert torch.equal(
        dequantize(cpu_vpanel.take_rows(packed, torch.tensor(ids)), torch.float32), want
    )


def test_declines_what_it_cannot_take() -> None:
    """N not a multiple of 32, fp8 codes against fp32 x (or without the fp8 kernel) and
    scattered groups: not taken (nor offered)."""
    assert not cpu_vpanel.takes(random_qtensor(48, 256, 4, 128))
    fp8 = QTensor(
        torch.zeros(32, 256, dtype=torch.float8_e4m3fn), torch.ones(32, 2), None, None, 8, 128, 256
    )
    assert not cpu_vpanel.takes(fp8, torch.float32)
    assert cpu_vpanel.takes(fp8, torch.bfloat16) == _has_fp8_kernel()
    assert (cpu_choice.PACKED in cpu_choice.offered([fp8], True, torch.float32)) is False
    w = random_qtensor(32, 256, 4, 128)
    scattered = QTensor(
        w.codes, w.scales, w.zeros, torch.arange(256, dtype=torch.int32) // 128, 4, 128, 256
    )
    assert not cpu_vpanel.takes(scattered)
    assert cpu_vpanel.takes(w) == _has_kernel()


def test_offered_only_where_packable_and_built() -> None:
    """The chooser times vnni_panel only for weights it may repack (not a mixture's experts),
    on a build that has the kernel, exact or under --cpu-quantized-activations int8."""
    w = random_qtensor(64, 512, 4, 128)
    assert cpu_choice.PACKED not in cpu_choice.offered([w])
    assert (cpu_choice.PACKED in cpu_choice.offered([w], packable=True)) == _has_kernel()
    cpu_kernels.set_quantized_activations("int8")
    try:
        assert (cpu_choice.PACKED in cpu_choice.offered([w], packable=True)) == _has_kernel()
    finally:
        cpu_kernels.set_quantized_activations("int16")


@needs_kernel
@pytest.mark.parametrize("bits,group,k", [f for f in FORMATS if f[1] != 16])  # x8_panel's
@pytest.mark.parametrize("rows", [1, 2, 8, 12, 13, 25, 64])
def test_8_bit_activations_round_x_as_x8_panel_does(
    bits: int, group: int, k: int, rows: int
) -> None:
    """Under --cpu-quantized-activations int8 the panels multiply x rounded to 8 bits per row
    and block of gcd(group, 128) features, as x8_panel (qvnni.c) does: the same bits, at one
    and two threads, in tiles of 12 rows (a row alone gives its bits in the batch too)."""
    w = random_qtensor(96, k, bits, group, seed=3)
    packed = cpu_vpanel.pack(w)
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 4).to(torch.bfloat16)
    cpu_kernels.set_quantized_activations("int8")
    try:
        outs = at_thread_counts(lambda: cpu_vpanel.vnni_panel(x, packed, torch.float32))
        want = cpu_panel.x8_panel(x, w, torch.float32)
        alone = cpu_vpanel.vnni_panel(x[-1:], packed, torch.float32)
    finally:
        cpu_kernels.set_quantized_activations("int16")
    assert all(torch.equal(y, want) for y in outs)
    assert torch.equal(alone[0], want[-1])


def _emulate_x8(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x rounded to 8 bits per row and block of gcd(group, 128) features (max|x| / 127 in fp32,
    x times its inverse, nearest even), then as _emulate: each block's integer sums exact,
    its zero points through its sum of x's codes, times the group's and the block's scales."""
    m, k = x.shape
    gs = w.group_size or k
    b = math.gcd(gs, 128)
    xf = x.float().view(m, k // b, b)
    amax = xf.abs().amax(-1)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(xf * (1.0 / s)[..., None]).clamp(-127, 127).double()
    codes = w.codes.double().view(-1, k // b, b)
    acc = torch.einsum("mbk,nbk->mnb", q, codes)
    per_block = torch.arange(k // b) * b // gs  # the group of each block
    zeros, scales = w.zeros.double()[:, per_block], w.scales.double()[:, per_block]
    t = acc - zeros[None] * q.sum(-1)[:, None, :]
    return (t * scales[None] * s.double()[:, None, :]).sum(-1)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 8, 13, 25])
def test_8_bit_codes_in_groups_of_16_against_x_in_8_bits(rows: int) -> None:
    """GGUF's Q6_K (8-bit codes, a scale and zero point per 16 features) under
    --cpu-quantized-activations int8, where x8_panel takes no such groups: x rounded per 16
    features, the float64 emulation's sums, at one and two threads, a row alone as in a batch."""
    w = random_qtensor(96, 512, 8, 16, seed=5)
    packed = cpu_vpanel.pack(w)
    x = (torch.randn(rows, 512) * torch.rand(rows, 1) * 4).to(torch.bfloat16)
    cpu_kernels.set_quantized_activations("int8")
    try:
        outs = at_thread_counts(lambda: cpu_vpanel.vnni_panel(x, packed, torch.float32))
        alone = cpu_vpanel.vnni_panel(x[-1:], packed, torch.float32)
    finally:
        cpu_kernels.set_quantized_activations("int16")
    ref = _emulate_x8(x, w)
    assert (outs[0].double() - ref).abs().max().item() <= 2e-6 * ref.abs().amax().item()
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(alone[0], outs[0][-1])


def test_its_layout_serves_every_row_count_or_none() -> None:
    """The packed layout replaces the row-major codes, so the picks are vnni_panel in every
    bucket or in none: in all where it is less slow on average (though slower at one row
    count), in none where it is slower on average or did not run somewhere."""
    n = len(kernel_choice.BUCKETS)
    defaults = ("qgemv",) * n
    faster = {"qgemv": [1.0] * n, cpu_choice.PACKED: [1.2] + [0.7] * (n - 1)}
    assert cpu_choice.one_layout(faster, defaults) == (cpu_choice.PACKED,) * n
    slower = {"qgemv": [1.0] * n, cpu_choice.PACKED: [0.5] + [1.3] * (n - 1)}
    assert cpu_choice.one_layout(slower, defaults) == defaults
    dropped = {"qgemv": [1.0] * n, cpu_choice.PACKED: [None] + [0.5] * (n - 1)}
    assert cpu_choice.one_layout(dropped, defaults) == defaults
    level = {"qgemv": [1.0] * n, cpu_choice.PACKED: [0.995] * n}  # within the layout margin
    assert cpu_choice.one_layout(level, defaults) == defaults


def _measure_scripted(
    monkeypatch: pytest.MonkeyPatch,
    names: tuple[str, ...],
    cost: Callable[[str, int, int], float],
) -> dict[str, list[float | None]]:
    """cpu_choice.measure over one small 8-bit weight, each run of candidate `name` taking
    cost(name, rows, call) seconds of a fake clock (`call`: its count at that row count, the
    first the warm-up); no packed copies made."""
    now = [0.0]
    calls: dict[tuple[str, int], int] = {}

    def scripted(name: str) -> Callable[..., None]:
        def run(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> None:
            rows = x.shape[0]
            calls[(name, rows)] = calls.get((name, rows), 0) + 1
            now[0] += cost(name, rows, calls[(name, rows)])

        return run

    for name in cpu_choice.CANDIDATES:
        monkeypatch.setitem(cpu_choice._RUN, name, scripted(name))
    monkeypatch.setattr(cpu_vpanel, "pack_copies", lambda ws: None)
    w = random_qtensor(64, 256, 8, 0)
    return cpu_choice.measure([w], torch.float32, clock=lambda: now[0], names=names)


def test_one_disturbed_pass_does_not_take_its_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure() drops a candidate still over 3x behind after its first passes, but never
    vnni_panel: a burst of other work over its first one-row pass (a memory phase change, a
    preemption) would have left None in that bucket, and one_layout then keeps the row-major
    codes for every row count however far ahead the panels are everywhere else."""
    first = kernel_choice.TIMED_ROWS[0]

    def cost(name: str, rows: int, call: int) -> float:
        if name == cpu_choice.PACKED:  # warm-up, then a first pass 4x the GEMV's
            return 40.0 if rows == first and call == 2 else 5.0
        return 10.0 if name == "qgemv" else 100.0

    timings = _measure_scripted(monkeypatch, ("qgemv", cpu_choice.PACKED), cost)
    assert None not in timings[cpu_choice.PACKED]
    defaults = ("qgemv",) * len(kernel_choice.BUCKETS)
    assert cpu_choice.one_layout(timings, defaults) == (cpu_choice.PACKED,) * len(defaults)


def test_one_disturbed_pass_does_not_drop_the_panels_best_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The packed layout is judged by its best kernel in each bucket. One disturbed first pass
    of amx_bf16_vpanel at 1024 rows (4x the leader; the next pass 2x ahead of it) dropped it
    there: vnni_panel's 4x slower time stood for the panels in that bucket and the row-major
    codes took every row count (on a Xeon with AMX: qgemv at one row, where vnni_panel read
    1.15x faster). A candidate now stops only when still 3x behind after two passes."""
    last = kernel_choice.TIMED_ROWS[-1]

    def cost(name: str, rows: int, call: int) -> float:
        if name == "qgemv":
            return 10.0
        if name == cpu_choice.PACKED:
            return 40.0 if rows == last else 9.0
        if rows == last:  # amx_bf16_vpanel: warm-up, a disturbed pass, then its pace
            return 40.0 if call == 2 else 5.0
        return 50.0

    names = ("qgemv", cpu_choice.PACKED, "amx_bf16_vpanel")
    timings = _measure_scripted(monkeypatch, names, cost)
    assert timings["amx_bf16_vpanel"][-1] == 5.0
    assert all(t is None for t in timings["amx_bf16_vpanel"][:-1])  # 5x behind: dropped
    defaults = ("qgemv",) * len(kernel_choice.BUCKETS)
    picks = (cpu_choice.PACKED,) * (len(defaults) - 1) + ("amx_bf16_vpanel",)
    assert cpu_choice.one_layout(timings, defaults) == picks


def test_the_row_major_codes_keep_a_pick_where_the_panels_run_far_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the panels are over 3x ahead of every row-major kernel (fp8 panels at 8 rows),
    the best row-major candidate still stays in the bucket: one_layout needs its picks over
    the row-major codes in every bucket (it failed: "no candidate ran for rows 2-4")."""

    def cost(name: str, rows: int, call: int) -> float:
        return {cpu_choice.PACKED: 1.0, "qgemv": 10.0}.get(name, 20.0)

    timings = _measure_scripted(monkeypatch, ("qgemv", "amx_int", cpu_choice.PACKED), cost)
    assert None not in timings["qgemv"] and all(t is None for t in timings["amx_int"])
    defaults = ("qgemv",) * len(kernel_choice.BUCKETS)
    assert cpu_choice.one_layout(timings, defaults) == (cpu_choice.PACKED,) * len(defaults)


needs_fp8_kernel = pytest.mark.skipif(
    not _has_fp8_kernel(), reason="no AVX512-VBMI build here (never offered)"
)
# Every e4m3 magnitude class: zeros, subnormals (down to 2^-9), normals, the largest (448).
FP8_SPECIAL = [0.0, -0.0, 2**-9, -(2**-9), 3 * 2**-9, 2**-6, 0.015, 1.0, -3.5, 240.0, 448.0]


def _fp8_weight(n: int, k: int, group: int) -> QTensor:
    codes = (torch.randn(n, k) * 40).to(torch.float8_e4m3fn)
    codes[0, : len(FP8_SPECIAL)] = torch.tensor(FP8_SPECIAL).to(torch.float8_e4m3fn)
    codes[n - 1, -len(FP8_SPECIAL) :] = torch.tensor(FP8_SPECIAL).to(torch.float8_e4m3fn)
    g = k // group if group else 1
    return QTensor(codes, torch.rand(n, g) + 0.25, None, None, 8, group, k)


def test_fp8_panels_wherever_the_build_has_avx512_vbmi() -> None:
    """The fp8 panels are in every AVX-512 build of a CPU with AVX512-VBMI, AVX512-BF16 or not
    (before, CPUs without it, Ice Lake among them, ran fp8 weights on the one-row GEMV alone:
    0.83x bf16's B=8 step on such a Xeon)."""
    if cpu_kernels.load() is None:
        pytest.skip("no CPU kernels here")
    flags = cpu_build.cpu_info()[1]
    assert _has_fp8_kernel() == (cpu_kernels.isa() == "avx512" and "avx512vbmi" in flags)


@needs_fp8_kernel
@pytest.mark.parametrize("group,k", [(128, 512), (0, 384)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17, 40])
def test_fp8_panels_multiply_the_exact_codes(group: int, k: int, rows: int) -> None:
    """fp8 codes as bf16 (every e4m3 value is one, subnormals included) against bf16 x: each
    product exact, sums in fp32: within fp32 rounding of a float64 product of the dequantized
    weight, at one and two threads alike, and a row's result the same alone as in a batch
    (past 8 rows the later tiles read the lines the first one made)."""
    w = _fp8_weight(96, k, group)
    packed = cpu_vpanel.pack(w)
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 4).to(torch.bfloat16)
    outs = at_thread_counts(lambda: cpu_vpanel.vnni_panel(x, packed, torch.float32))
    assert torch.equal(outs[0], outs[1])
    want = x.double() @ dequantize(w, torch.float64).T
    # fp32 sums of K products: error within K * eps * the sum of |products|
    bound = k * 2**-23 * (x.double().abs() @ dequantize(w, torch.float64).abs().T)
    assert ((outs[0].double() - want).abs() <= bound + 1e-30).all()
    alone = torch.cat(
        [cpu_vpanel.vnni_panel(x[i : i + 1], packed, torch.float32) for i in range(rows)]
    )
    assert torch.equal(alone, outs[0])


@needs_fp8_kernel
def test_fp8_panels_keep_their_rows_for_lookups() -> None:
    """A packed fp8 table's rows (take_rows in torch, dequant_rows in C) are the row-major
    table's: its codes byte for byte, its values as qtensor.dequantize gives them."""
    w = _fp8_weight(64, 256, 128)
    packed = cpu_vpanel.pack(w)
    ids = [0, 5, 16, 31, 32, 63]
    got = cpu_vpanel.take_rows(packed, torch.tensor(ids))
    assert torch.equal(got.codes.view(torch.uint8), w.codes[ids].view(torch.uint8))
    assert torch.equal(got.scales, w.scales[ids])
    want = dequantize(w, torch.float32)[ids]
    assert torch.equal(cpu_vpanel.dequant_rows(packed, ids), want)


@needs_fp8_kernel
def test_fp8_panels_refuse_fp32_x() -> None:
    """Their products are bf16 pairs: fp32 x would be rounded, so it is refused, not run."""
    packed = cpu_vpanel.pack(_fp8_weight(32, 256, 128))
    with pytest.raises(ValueError, match="bf16"):
        cpu_vpanel.vnni_panel(torch.randn(1, 256), packed)


@needs_kernel
def test_each_timed_pass_reads_its_codes_from_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed pass of the quantized chooser is preceded by a flush of what it reads out
    of the caches (the codes, scales and zero points; for vnni_panel its packed copy's), as
    cpu_linear's passes are: with a last-level cache larger than the timing set (a Xeon VM's
    480 MB L3) the passes ran from it and the picks followed the kernels' arithmetic, not a
    step's (qgemv kept at 8 rows where amx_int is 1.15x faster from memory)."""
    passes = Passes(monkeypatch)
    w = random_qtensor(64, 256, 8, 0)
    cpu_choice.measure([w], torch.float32, clock=passes.clock, names=("qgemv", cpu_choice.PACKED))
    assert passes.each_flushed()
    packed = cpu_vpanel.packed_copy(w)
    for q in (w, packed):  # the row-major codes' passes, and the panels'
        assert any({q.codes.data_ptr(), q.scales.data_ptr()} <= p for p in passes.flushed())


@needs_kernel
@pytest.mark.parametrize("faster", [True, False])
def test_the_one_row_prefetch_is_on_where_it_measured_faster(
    monkeypatch: pytest.MonkeyPatch, faster: bool
) -> None:
    """Measured once per process on the running machine (the first pack): on where a cold
    one-row pass ran 3% faster with it, off where it did not; either way the same bits."""
    lib = cpu_kernels.load()
    assert lib is not None and lib.vp_row_prefetch is not None
    real = cpu_vpanel.vnni_panel
    time_by_switch(monkeypatch, cpu_vpanel, "vnni_panel", lib.vp_row_prefetch, faster)
    measure_only(monkeypatch, cpu_vpanel, "_ROW_PREFETCH_MEASURED")
    monkeypatch.setattr(cpu_vpanel, "_ROW_PREFETCH_BYTES", 1 << 20)
    before = lib.vp_row_prefetch.value
    try:
        w = cpu_vpanel.pack(random_qtensor(64, 512, 4, 128, seed=2))
        assert lib.vp_row_prefetch.value == int(faster)
        x = torch.randn(1, 512, dtype=torch.bfloat16)
        outs = []
        for on in (0, 1):
            lib.vp_row_prefetch.value = on
            outs.append(real(x, w, torch.float32))
        assert torch.equal(outs[0], outs[1])
    finally:
        lib.vp_row_prefetch.value = before


@needs_kernel
@pytest.mark.parametrize("bits,group,k", FORMATS)
@pytest.mark.parametrize("rows", [16, 17, 40])
def test_chunks_widened_once_for_all_tiles_give_the_same_bits(
    bits: int, group: int, k: int, rows: int
) -> None:
    """Many rows with each chunk's codes widened once (minus their zero points) for all row
    tiles: the bits of the per-tile form, at one and two threads (17 rows: a one-row tail
    tile, which 4-bit codes run on their split bytes)."""
    lib = cpu_kernels.load()
    assert lib is not None
    switch = lib.vp_wide_rows[bits]
    w = random_qtensor(96, k, bits, group, seed=rows)
    packed = cpu_vpanel.pack(w)
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 4).to(torch.bfloat16)
    before = switch.value
    outs = {}
    try:
        for start in (0, 1, rows):  # never, always, from this row count
            switch.value = start
            outs[start] = at_thread_counts(lambda: cpu_vpanel.vnni_panel(x, packed, torch.float32))
    finally:
        switch.value = before
    for start in (1, rows):
        assert all(torch.equal(a, b) for a, b in zip(outs[start], outs[0]))
    ref = _emulate(x, w)
    assert (outs[1][0].double() - ref).abs().max().item() <= 2e-6 * ref.abs().amax().item()


@needs_kernel
@pytest.mark.parametrize("faster", [True, False])
def test_chunks_are_widened_from_the_rows_where_that_measured_faster(
    monkeypatch: pytest.MonkeyPatch, faster: bool
) -> None:
    """Measured once per process on the running machine (the first pack), per code width: from
    the fewest rows timed where the widened form ran 3% faster there and at every larger count
    timed; never where it did not."""
    lib = cpu_kernels.load()
    assert lib is not None and set(lib.vp_wide_rows) == {8, 4}

    def switch_of(x: torch.Tensor, w: QTensor) -> object:  # the switch this call's run reads
        return lib.vp_wide_rows[w.bits]

    time_by_switch(monkeypatch, cpu_vpanel, "vnni_panel", switch_of, faster)
    measure_only(monkeypatch, cpu_vpanel, "_WIDE_ROWS_MEASURED")
    monkeypatch.setattr(cpu_vpanel, "_WIDE_SHAPE", (64, 256))
    before = {b: s.value for b, s in lib.vp_wide_rows.items()}
    try:
        cpu_vpanel.pack(random_qtensor(64, 512, 4, 128, seed=3))
        want = cpu_vpanel._WIDE_ROWS[0] if faster else 0
        assert {b: s.value for b, s in lib.vp_wide_rows.items()} == {8: want, 4: want}
    finally:
        for b, s in lib.vp_wide_rows.items():
            s.value = before[b]
