"""The CPU kernels against float64 references: matmuls at every row count the engine may route
to them (every matmul candidate, tails included) and paged decode attention with GQA."""

from __future__ import annotations

import ctypes
import functools
import itertools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers import cpu_build, cpu_kernels
from minisgl.testing.switch_clock import check_measured_once
from minisgl.testing.threads import at_thread_counts

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no AVX2 kernels here")


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 13, 15, 16, 17, 20, 32, 40, 200])
def test_matmul_matches_reference(wdtype: torch.dtype, rows: int) -> None:
    """Our GEMV and GEMM at any row count (the chooser may give either any bucket; the GEMM's
    row tiles of 3 to 6 in each split it makes: 7 = 4 + 3, 8 = 4 + 4, 13, 20, 32, the chunk
    boundary at 192)."""
    torch.manual_seed(rows)
    n, k = 37, 96  # N not a multiple of the 16-row panel or the 4-row block
    w = torch.randn(n, k).to(wdtype)
    x = torch.randn(rows, k)
    ref = F.linear(x.double(), w.double())
    for f in (cpu_kernels.gemv, cpu_kernels.gemm):
        y = f(x, w)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
        # bf16 output: fp32 result rounded to nearest even, as torch's cast does
        yb = f(x.bfloat16(), w, torch.bfloat16)
        assert yb.dtype == torch.bfloat16
        assert torch.equal(yb, f(x.bfloat16(), w).to(torch.bfloat16))
        # bf16 x (the GEMV converts it itself): the same sums as from its fp32 copy
        xb = x.bfloat16()
        assert torch.equal(f(xb, w, torch.float32), f(xb.float(), w))


@pytest.mark.parametrize("rows", [*range(1, 18), 21, 23, 31, 64, 96, 100, 161, 320])
@pytest.mark.parametrize("k", [96, 544, 2080])  # chunks: one short; panel.c's and panel512.c's
def test_panel_matmul_matches_reference(rows: int, k: int) -> None:
    """bf16 weights repacked into the build's panels (panel.c, AVX2: 16 columns, row tiles of
    1-6, a converted chunk from 17 rows, passes of 96; panel512.c, AVX-512: 32 columns with K
    in pairs, one tile of up to 12 rows, else K in chunks of 2048 under tiles of up to 8 rows,
    passes of 160; bf16 x widened to fp32 where the CPU lacks AVX512-BF16),
    N not a multiple of either panel width; bf16 x (on panel512.c exact bf16 products summed
    in fp32, as VDPBF16PS does) or fp32 x, either output, against the product in float64 of
    the same values: fp32 sums, only their order differs."""
    torch.manual_seed(rows + k)
    n = 37
    w = torch.randn(n, k).bfloat16()
    packed = cpu_kernels.panel_pack(w)
    width = 32 if cpu_kernels.panel_pairs() else 16
    assert packed.pairs == cpu_kernels.panel_pairs() and packed.n == n
    assert packed.data.shape == (-(-n // width), k, width)
    x = torch.randn(rows, k)
    for xin in (x, x.bfloat16()):
        ref = F.linear(xin.double(), w.double())
        y = cpu_kernels.panel(xin, packed, torch.float32)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        # fp32 rounding of sums of k terms of about 1: the absolute error grows with k
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * max(1, k / 512))
        # bf16 output: the fp32 result rounded to nearest even, as torch's cast does
        yb = cpu_kernels.panel(xin, packed, torch.bfloat16)
        assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.bfloat16())
    assert cpu_kernels.panel(x.bfloat16(), packed).dtype == torch.bfloat16  # x's by default


def test_panel_rows_are_the_weights_rows() -> None:
    """An embedding lookup from a tied LM head's panels (the only copy of the table) gives the
    weight's rows, in the build's layout: every column of a panel, the zero-padded last panel,
    ids of any shape; K a multiple of 32 and one that is not (panel512.c packs 16 pairs at a
    time, the rest one by one), and the product from those panels as the weight's."""
    torch.manual_seed(0)
    for k in (64, 80):
        w = torch.randn(77, k).bfloat16()
        packed = cpu_kernels.panel_pack(w)
        ids = torch.tensor([[0, 1, 15, 16, 17], [31, 32, 33, 63, 64], [65, 70, 75, 76, 8]])
        assert torch.equal(cpu_kernels.panel_rows(packed, ids), w[ids])
        assert torch.equal(cpu_kernels.panel_rows(packed, torch.tensor(76)), w[76])
        x = torch.randn(3, k).bfloat16()
        torch.testing.assert_close(
            cpu_kernels.panel(x, packed, torch.float32).double(),
            F.linear(x.double(), w.double()),
            rtol=1e-5,
            atol=1e-4,
        )


def _own_build(tmp_path: Path, src: str, drop: frozenset[str]) -> ctypes.CDLL:
    """`src` compiled alone for this CPU's AVX-512 build less the CPU flags `drop`."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    flags = cpu_build.compile_flags("avx512", cpu_build.cpu_info()[1] - drop)
    # A name of its own per build: dlopen hands back a library already loaded from a path.
    out = tmp_path / f"{Path(src).stem}-{'-'.join(sorted(drop))}.so"
    cmd = [cc, "-O2", *flags, "-fopenmp", "-fPIC", f"-I{cpu_build.CSRC}", "-shared"]
    subprocess.run([*cmd, str(cpu_build.CSRC / src), "-o", str(out)], check=True)
    return ctypes.CDLL(str(out))


@pytest.mark.skipif(
    cpu_build.pick_isa(cpu_build.cpu_info()[1]) != "avx512", reason="no AVX-512 on this CPU"
)
def test_avx512_panels_without_native_bf16_run_fma_tiles_on_the_pairs_layout(
    tmp_path: Path,
) -> None:
    """On an AVX-512 CPU without AVX512-BF16 (compiled here without it) panel512.c serves on its
    own layout (32 columns, K in pairs) with bf16 x widened to fp32 for 16-lane FMAs, and
    panel.c's 8-lane tiles are not in the build (before, they were: half the FMA width); the
    embedding lookup reads its rows from the pairs. Row counts: the split tiles (1-3), the
    wide ones (4-12), K in chunks (13, 20), two passes (161)."""
    assert not hasattr(_own_build(tmp_path, "panel.c", frozenset()), "panel_bf16")
    lib = _own_build(tmp_path, "panel512.c", frozenset({"avx512_bf16"}))
    assert ctypes.c_int.in_dll(lib, "panel_layout").value == 1
    lib.panel_pack_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 2
    lib.panel_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    torch.manual_seed(0)
    n, k = 37, 2080
    w = torch.randn(n, k).bfloat16()
    data = torch.empty(2, k, 32, dtype=torch.bfloat16)
    lib.panel_pack_bf16(w.data_ptr(), data.data_ptr(), n, k)
    ids = torch.tensor([0, 7, 8, 15, 16, 31, 32, 36])
    packed = cpu_kernels.PanelWeight(data, n, pairs=True)
    assert torch.equal(cpu_kernels.panel_rows(packed, ids), w[ids])
    for rows in (1, 2, 3, 4, 7, 12, 13, 20, 161):
        x = torch.randn(rows, k)
        for xin in (x, x.bfloat16()):
            ref = F.linear(xin.double(), w.double())
            y, yb = torch.empty(rows, n), torch.empty(rows, n, dtype=torch.bfloat16)
            x_bf16 = int(xin.dtype == torch.bfloat16)
            lib.panel_bf16(xin.data_ptr(), data.data_ptr(), y.data_ptr(), rows, n, k, 0, x_bf16)
            lib.panel_bf16(xin.data_ptr(), data.data_ptr(), yb.data_ptr(), rows, n, k, 1, x_bf16)
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * k / 512)
            assert torch.equal(yb, y.bfloat16())  # rounded to the nearest, ties to even


def test_panel_prefetch_switches_change_no_result() -> None:
    """panel512.c's prefetch distances and caches (switches the benchmarks flip; one pair for
    fewer than 7 rows, one for more, and whether fewer take the pair of more: start-up measures
    that one) only move lines between caches: the same bits, whatever they are, for bf16 and
    fp32 x, with the prefetch into L1, into L2 and none (past the end); 16 and 40 rows: the
    K-chunked passes, whose prefetch of the next chunk goes into L2 (in one tile or two)."""
    lib = cpu_kernels.load()
    if lib is None or lib.panel512_pf_ahead is None:  # panel.c's panels: no such switches
        return
    switches = (
        lib.panel512_pf_ahead,
        lib.panel512_pf_l2,
        lib.panel512_pf_many_ahead,
        lib.panel512_pf_many_l2,
        lib.panel_few_rows_far,
        lib.panel512_spread,
    )
    settings = ((0, 0), (64, 1), (8192, 1), (1 << 16, 0), (1 << 40, 1))
    values = [
        (ahead, l2, ahead, 1 - l2, few, few)
        for (ahead, l2), few in itertools.product(settings, (0, 1))
    ]
    _same_bits_whatever_the_switches(512, (1, 2, 6, 7, 8, 9, 12, 16, 40), switches, values, 1e-4)


def _same_bits_whatever_the_switches(
    k: int, row_counts: tuple[int, ...], switches: tuple[Any, ...], values: list[Any], atol: float
) -> None:
    """panel() of 300 x k bf16 panels (far enough ahead for the prefetch to run) at each row
    count, bf16 and fp32 x: the product within fp32 sums of the float64 one, and the same bits
    with the C switches at each tuple of `values` (restored after)."""
    torch.manual_seed(0)
    w = torch.randn(300, k).bfloat16()
    packed = cpu_kernels.panel_pack(w)
    saved = [s.value for s in switches]
    for rows in row_counts:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, k).to(dtype)
            y = cpu_kernels.panel(x, packed, torch.float32)
            ref = F.linear(x.double(), w.double())
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=atol)
            try:
                for setting in values:
                    for s, v in zip(switches, setting, strict=True):
                        s.value = v
                    assert torch.equal(cpu_kernels.panel(x, packed, torch.float32), y)
            finally:
                for s, v in zip(switches, saved, strict=True):
                    s.value = v


def test_avx2_panel_prefetch_switches_change_no_result() -> None:
    """panel.c's prefetch distance for passes of up to 16 rows, and whether they take the
    distance of more rows' (start-up measures that one), only move lines between caches: the
    same bits, whatever they are, for bf16 and fp32 x, with the prefetch at the read, near,
    far and none (past the end); 17 and 40 rows: passes whose tiles read each chunk converted
    to fp32 first or convert it themselves (start-up measures that too), 70 rows: always
    converted first: the same bits."""
    lib = cpu_kernels.load()
    if lib is None or lib.panel_pf_near is None:
        pytest.skip("panel512.c's panels (AVX-512 build): the test above")
    switches = (lib.panel_pf_near, lib.panel_few_rows_far, lib.panel_convert_first)
    aheads = (0, 64, 2048, 1 << 16, 1 << 40)
    values = list(itertools.product(aheads, (0, 1), (0, 1)))
    _same_bits_whatever_the_switches(1024, (1, 2, 3, 6, 8, 16, 17, 40, 70), switches, values, 2e-4)


@pytest.mark.parametrize("faster", [True, False])
def test_few_panel_rows_prefetch_far_where_it_measured_faster(
    monkeypatch: pytest.MonkeyPatch, faster: bool
) -> None:
    """Measured once per process on the running machine (where the chooser first offers the
    panels), in either build: few rows (panel512.c: below 7, panel.c: up to 16) prefetch as
    more rows do where 1 and 4 rows against cold panels ran 3% faster that way, else near."""
    lib = cpu_kernels.load()
    assert lib is not None
    check_measured_once(
        monkeypatch, "panel", lib.panel_few_rows_far, "_PANEL_FEW_MEASURED", "_PANEL_FEW_SHAPE",
        faster, lambda names: "panel" in names,
    )  # fmt: skip


@pytest.mark.parametrize("faster", [True, False])
def test_many_panel_rows_convert_chunks_first_where_it_measured_faster(
    monkeypatch: pytest.MonkeyPatch, faster: bool
) -> None:
    """panel.c (AVX2 build): measured once per process on the running machine, where the
    chooser first offers the panels, whether passes of 17-64 rows convert each chunk first: so
    where 32 rows against cold panels ran 3% faster that way, else in the tiles."""
    lib = cpu_kernels.load()
    if lib is None or lib.panel_convert_first is None:
        pytest.skip("panel512.c's panels (AVX-512 build): no chunks converted first")
    check_measured_once(
        monkeypatch, "panel", lib.panel_convert_first, "_PANEL_CONVERT_MEASURED",
        "_PANEL_CONVERT_SHAPE", faster, lambda names: "panel" in names,
    )  # fmt: skip


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [*range(1, 17), 17, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_avx512_gemv_matches_reference(wdtype: torch.dtype, rows: int, threads: int) -> None:
    """x in the weight's dtype (bf16 products are exact, sums in fp32, as oneDNN's). Every
    tile the kernel picks by row count (8x1, 8x2, passes of 1-4 rows over half blocks), N
    ending in a partial 8-row block of more and of fewer than 4 rows, and blocks far enough
    ahead for the prefetch; on one thread and on two."""
    torch.manual_seed(rows)
    lib = cpu_kernels.load()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for n, k in ((37, 96), (43, 64), (3, 32)):
            w = torch.randn(n, k).to(wdtype)
            x = torch.randn(rows, k).to(wdtype)
            if lib is None or lib.gemv512_bf16 is None:  # the AVX2 build: no such candidate
                assert not cpu_kernels.supports_gemv512(wdtype, w)
                return
            assert cpu_kernels.supports_gemv512(wdtype, w)
            ref = F.linear(x.double(), w.double())
            y = cpu_kernels.gemv512(x, w, torch.float32)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
            yb = cpu_kernels.gemv512(x, w)
            assert yb.dtype == wdtype and torch.equal(yb, y.to(wdtype))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_avx512_gemv_rows_in_turn_give_the_same_bits(wdtype: torch.dtype) -> None:
    """gemv512 reading each 8-row block's rows one after another (one sequential stream, up
    to 8 input rows; 9 read them together either way) computes every sum in the same order as
    the rows read together: the same bits whichever way start-up measured faster. No rows of x
    (a step with nothing to sample) give an empty result, and nothing is written past it. N ending in a partial block, K whole
    4-vector steps and not (the prefetch runs per 4 vectors), on one thread and on two."""
    lib = cpu_kernels.load()
    if lib is None or lib.gemv512_bf16 is None:  # the AVX2 build: no such kernel
        return
    torch.manual_seed(1)
    before = lib.gemv512_rows_in_turn.value
    try:
        for (n, k), rows in itertools.product(((203, 512), (37, 96)), range(10)):
            w, x = torch.randn(n, k).to(wdtype), torch.randn(rows, k).to(wdtype)
            outs = {}
            for on in (0, 1):
                lib.gemv512_rows_in_turn.value = on
                outs[on] = at_thread_counts(
                    functools.partial(cpu_kernels.gemv512, x, w, torch.float32)
                )
            ref = F.linear(x.double(), w.double())
            torch.testing.assert_close(outs[1][0].double(), ref, rtol=1e-5, atol=1e-4)
            assert all(torch.equal(outs[0][0], y) for y in outs[0] + outs[1])
    finally:
        lib.gemv512_rows_in_turn.value = before


@pytest.mark.parametrize("faster", [True, False])
def test_avx512_gemv_reads_rows_in_turn_where_it_measured_faster(
    monkeypatch: pytest.MonkeyPatch, faster: bool
) -> None:
    """Measured once per process on the running machine (where the chooser first offers
    gemv512): rows in turn where a cold one-row pass ran 3% faster that way, else together."""
    lib = cpu_kernels.load()
    if lib is None or lib.gemv512_bf16 is None:  # the AVX2 build: no such kernel
        return
    check_measured_once(
        monkeypatch, "gemv512", lib.gemv512_rows_in_turn, "_ROWS_IN_TURN_MEASURED",
        "_ROWS_IN_TURN_SHAPE", faster, lambda names: names[:2] == ["gemv", "gemv512"],
        small=(512, 256),
    )  # fmt: skip


def test_avx512_gemv_prefetch_switch_changes_no_result() -> None:
    """gemv512's prefetch into L1 instead of L2 (a switch the benchmarks flip) only moves
    lines between caches: the same bits, and the switch back at its default afterwards."""
    lib = cpu_kernels.load()
    if lib is None or lib.gemv512_bf16 is None:  # the AVX2 build: no such kernel
        return
    torch.manual_seed(0)
    w = torch.randn(203, 256).bfloat16()  # blocks far enough ahead for the prefetch to run
    for rows in (1, 2, 5):
        x = torch.randn(rows, 256).bfloat16()
        assert lib.gemv512_prefetch_l1.value == 0
        y = cpu_kernels.gemv512(x, w, torch.float32)
        lib.gemv512_prefetch_l1.value = 1
        try:
            assert torch.equal(cpu_kernels.gemv512(x, w, torch.float32), y)
        finally:
            lib.gemv512_prefetch_l1.value = 0


@pytest.mark.skipif(
    cpu_build.pick_isa(cpu_build.cpu_info()[1]) != "avx512", reason="no AVX-512 on this CPU"
)
def test_avx512_gemv_without_native_bf16_matches_reference(tmp_path: Path) -> None:
    """gemv512 as built for an AVX-512 CPU without AVX512-BF16 (Skylake-X, Ice Lake): bf16
    widened to fp32 FMAs, the loop 16 values a step. This CPU may have native bf16 dot products
    and then never runs that path in its own build: compiled here without them."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    flags = cpu_build.compile_flags("avx512", cpu_build.cpu_info()[1] - {"avx512_bf16"})
    src, lib_path = cpu_build.CSRC / "gemv_avx512.c", tmp_path / "gemv512.so"
    cmd = [cc, "-O2", *flags, "-fopenmp", "-fPIC", "-shared", str(src), "-o", str(lib_path)]
    subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.gemv512_bf16
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.restype = None
    in_turn = ctypes.c_int.in_dll(lib, "gemv512_rows_in_turn")
    torch.manual_seed(0)
    for rows in (1, 2, 3, 5, 9):
        w, x = torch.randn(37, 96).bfloat16(), torch.randn(rows, 96).bfloat16()
        ref = F.linear(x.double(), w.double())
        ys = []
        for on in (0, 1):  # the block's rows together, then in turn (up to 8 rows)
            in_turn.value = on
            ys.append(torch.empty(rows, 37))
            fn(x.data_ptr(), w.data_ptr(), ys[-1].data_ptr(), rows, 37, 96, 0)
            torch.testing.assert_close(ys[-1].double(), ref, rtol=1e-5, atol=1e-4)
        assert torch.equal(ys[0], ys[1])


def test_read_bandwidth_is_measured() -> None:
    bw = cpu_kernels.read_bandwidth(64 << 20, repeats=1)
    assert bw is not None and bw > 1e8


def test_fma_issue_rate_is_measured() -> None:
    """The compute ceiling the benchmarks print: FLOPs counted per thread and vector lane, so
    more threads never read as less."""
    one = cpu_kernels.fma_flops(iters=200_000, repeats=2)
    assert one is not None and one > 1e9
    lib = cpu_kernels.load()
    assert lib is not None
    sink = ctypes.c_float()
    done = lib.fma_peak(1000, ctypes.byref(sink))
    lanes = 16 if cpu_kernels.isa() == "avx512" else 8
    assert done == torch.get_num_threads() * 1000 * 12 * lanes * 2
    assert sink.value > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 32), (6, 2, 40), (4, 4, 16)])  # odd group, tails
def test_decode_attention_matches_sdpa(dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    torch.manual_seed(0)
    slots = 700
    k_pool = torch.randn(slots, hkv, d).to(dtype)
    v_pool = torch.randn(slots, hkv, d).to(dtype)
    # Requests split into several key chunks (up to 128 each) and merged, or kept whole.
    lens = torch.tensor([1, 7, 30, 129, 600], dtype=torch.int64)
    table = torch.stack([torch.randperm(slots)[:600] for _ in range(5)])  # scattered slots
    table[4] = torch.arange(600)  # and one request's keys on whole pages, in order
    # q as the model passes it: the query heads of a [T, Hq + Hkv, D] tensor (not contiguous).
    q = torch.randn(5, hq + hkv, d).to(dtype)[:, :hq]
    out = cpu_kernels.decode_attention(q, k_pool, v_pool, table, lens, d**-0.5)
    assert out.shape == (5, hq * d) and out.dtype == dtype
    # Alone, a request is split differently (chunks follow the batch's total; a request alone
    # in as few chunks as fill the threads): same answer.
    for b in range(5):
        sl = slice(b, b + 1)
        alone = cpu_kernels.decode_attention(q[sl], k_pool, v_pool, table[sl], lens[sl], d**-0.5)
        torch.testing.assert_close(alone, out[sl], rtol=1e-2, atol=1e-2)
    for b in range(5):
        sl = table[b, : lens[b]]
        kk = k_pool[sl].double().transpose(0, 1)  # [Hkv, n, D]
        vv = v_pool[sl].double().transpose(0, 1)
        ref = F.scaled_dot_product_attention(
            q[b].double()[:, None], kk, vv, scale=d**-0.5, enable_gqa=True
        )  # [Hq, 1, D]
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[b].double(), ref.reshape(-1), rtol=tol, atol=tol)


@pytest.mark.parametrize("d", [128, 64, 40])
def test_decode_attention_s_16_lane_passes_match_the_8_lane_ones(d: int) -> None:
    """bf16 pools on the AVX-512 build: the values' pass on 16 lanes gives the same bits as on
    8 (fp32 out), and q.k on VDPBF16PS (bf16 q) what the widened FMAs give up to the order of
    the sums; a head width that is no multiple of 32 keeps the 8-lane passes."""
    lib = cpu_kernels.load()
    assert lib is not None
    switches = [s for s in (lib.attn_v512, lib.attn_dpbf16) if s is not None]
    saved = [s.value for s in switches]
    torch.manual_seed(d)
    hq, hkv, slots = 16, 8, 400
    k_pool = torch.randn(slots, hkv, d).to(torch.bfloat16)
    v_pool = torch.randn(slots, hkv, d).to(torch.bfloat16)
    lens = torch.tensor([1, 9, 65, 321], dtype=torch.int64)
    table = torch.stack([torch.randperm(slots)[:321] for _ in range(4)])
    q = torch.randn(4, hq, d)

    def run(q: torch.Tensor, v512: int, dpbf16: int) -> torch.Tensor:
        if lib.attn_v512 is not None:
            lib.attn_v512.value = v512
        if lib.attn_dpbf16 is not None:
            lib.attn_dpbf16.value = dpbf16
        return cpu_kernels.decode_attention(q, k_pool, v_pool, table, lens, d**-0.5)

    try:
        assert torch.equal(run(q, 1, 1), run(q, 0, 1))  # fp32 q: no VDPBF16PS
        qb = q.to(torch.bfloat16)
        wide, narrow = run(qb, 1, 1), run(qb, 0, 0)
        torch.testing.assert_close(wide.float(), narrow.float(), rtol=1e-2, atol=1e-2)
    finally:
        for s, v in zip(switches, saved, strict=True):
            s.value = v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_stores_the_new_rows_first(dtype: torch.dtype) -> None:
    """The step's new keys and values handed to the kernel (views of the model's q/k and qkv
    tensors, as a decode step has them) land in the pools at their slots, and the attention
    reads them: the same answer as storing them with torch first."""
    torch.manual_seed(1)
    hq, hkv, d, slots = 8, 2, 32, 64
    k_pool = torch.randn(slots, hkv, d).to(dtype)
    v_pool = torch.randn(slots, hkv, d).to(dtype)
    lens = torch.tensor([5, 17, 1], dtype=torch.int64)
    table = torch.stack([torch.randperm(slots)[:20] for _ in range(3)])
    where = torch.stack([table[b, lens[b] - 1] for b in range(3)])  # each request's new slot
    qk = torch.randn(3, hq + hkv, d).to(dtype)
    qkv = torch.randn(3, (hq + 2 * hkv) * d).to(dtype)
    q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d :].view(3, hkv, d)
    assert cpu_kernels.can_write_new(k_pool, k, v)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    k_ref.index_copy_(0, where, k)
    v_ref.index_copy_(0, where, v)
    want = cpu_kernels.decode_attention(q, k_ref, v_ref, table, lens, d**-0.5)
    got = cpu_kernels.decode_attention(q, k_pool, v_pool, table, lens, d**-0.5, (k, v, where))
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    assert torch.equal(got, want)
    # Rows the kernel cannot take as they are (another dtype, heads not packed) are refused.
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert not cpu_kernels.can_write_new(k_pool, k.to(other), v)
    assert not cpu_kernels.can_write_new(k_pool, k[:, :, ::2], v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_matches_eager(dtype: torch.dtype) -> None:
    from minisgl.layers.activation import silu_and_mul

    torch.manual_seed(0)
    x = (torch.randn(37, 2 * 44) * 4).to(dtype)  # I = 44: vector body and scalar tail
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated exp, both signs
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_and_mul(x)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # same roundings; the exp may differ in its last fp32 bit, rarely moving a bf16 ulp
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_norm_with_rotary_matches_two_steps(dtype: torch.dtype) -> None:
    from minisgl.layers.norm import head_rms_norm, head_rms_norm_rotary
    from minisgl.layers.rotary import RotaryEmbedding, apply_rotary

    torch.manual_seed(0)
    t, h, d = 9, 6, 64
    qkv = torch.randn(t, (h + 2) * d).to(dtype)
    x = qkv[:, : h * d].view(t, h, d)  # strided rows, as in the model
    w = torch.randn(h, d).to(dtype)
    cos, sin = RotaryEmbedding(d, 10000.0, None, 128).cos_sin(torch.arange(3, 3 + t), dtype)
    # Shared by every layer of a step: contiguous, so the kernel reads them without a copy.
    assert cos.is_contiguous() and sin.is_contiguous()
    got = head_rms_norm_rotary(x, w, 1e-6, cos, sin)
    want = apply_rotary(head_rms_norm(x, w, 1e-6), cos, sin)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 44])  # 8-lane body only; body and a scalar tail
def test_norm_kernel_matches_eager(dtype: torch.dtype, d: int) -> None:
    from minisgl.layers.norm import rms_normalize
    from minisgl.layers.rotary import RotaryEmbedding, apply_rotary

    torch.manual_seed(0)
    x, res = (torch.randn(11, d) * 3).to(dtype), torch.randn(11, d).to(dtype)
    w = torch.randn(d).to(dtype)
    out, summed = cpu_kernels.rms_norm(x, w, 1e-6, res)
    assert summed is not None
    torch.testing.assert_close(summed, x + res, rtol=0, atol=0)  # the add rounds as torch's

    def same(got: torch.Tensor, want: torch.Tensor) -> None:
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # the sum of squares' order may move a bf16 ulp, rarely
            assert (got != want).float().mean() < 0.02
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)

    same(out, w * rms_normalize(x + res, 1e-6))
    heads = x.view(11, 1, d)
    cos, sin = RotaryEmbedding(d, 10000.0, None, 64).cos_sin(torch.arange(11), dtype)
    roped = cpu_kernels.rms_norm(heads, w, 1e-6, rope=(cos, sin))[0]
    same(roped, apply_rotary(w * rms_normalize(heads, 1e-6), cos, sin))


def test_split_point_weighs_the_fork_against_the_arithmetic_it_saves() -> None:
    """Rows split over the threads only where the time they save pays the threads' wake-up
    twice: with a 5 us wake-up and 1 ns a value, a B=1 row (1024 values) stays on one thread,
    a prefill chunk (4096 x 1024) splits; one thread never splits."""
    never = 2**63 - 1
    point = cpu_kernels.split_point(5e-6, 1e-9, threads=2)
    assert point == 20_000
    assert 1024 < point < 4096 * 1024
    assert cpu_kernels.split_point(5e-6, 1e-9, threads=4) == 13_334  # more threads save more
    assert cpu_kernels.split_point(5e-6, 1e-9, threads=1) == never
    assert cpu_kernels.split_point(1.0, 1e-30, threads=2) == never  # no overflow
    points = cpu_kernels.split_points()  # measured on this machine when the kernels loaded
    assert set(points) == {"norm", "silu"} and all(p >= 1 for p in points.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_elementwise_kernels_agree_split_or_not(dtype: torch.dtype) -> None:
    """Whatever the measured split points, the kernels give the same rows on one thread and
    split over all of them."""
    lib = cpu_kernels.load()
    assert lib is not None
    torch.manual_seed(0)
    x, res = torch.randn(37, 1024).to(dtype), torch.randn(37, 1024).to(dtype)
    w = torch.randn(1024).to(dtype)
    gate_up = torch.randn(37, 2 * 1024).to(dtype)
    saved = lib.norm_parallel_min.value, lib.silu_parallel_min.value
    results = []
    try:
        for point in (0, 2**63 - 1):
            lib.norm_parallel_min.value = lib.silu_parallel_min.value = point
            out, summed = cpu_kernels.rms_norm(x, w, 1e-6, res)
            results.append((out, summed, cpu_kernels.silu_mul(gate_up)))
    finally:
        lib.norm_parallel_min.value, lib.silu_parallel_min.value = saved
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_matmuls_give_the_same_bits_however_the_threads_share_the_work() -> None:
    """The GEMV and panel matmuls hand out their weight blocks to whichever thread is free
    (a thread that finishes first takes blocks from the end of another's run): each output is
    still computed by one thread in one order, so one thread, all threads and repeated calls
    agree to the bit."""
    torch.manual_seed(0)
    n, k = 1000, 512  # many blocks and panels, N not a multiple of either
    w = torch.randn(n, k).bfloat16()
    packed = cpu_kernels.panel_pack(w)
    x = torch.randn(8, k).bfloat16()
    wide = cpu_kernels.supports_gemv512(x.dtype, w)  # the AVX-512 GEMV, where it is built

    def outputs() -> list[torch.Tensor]:
        out = [cpu_kernels.gemv(x, w), cpu_kernels.panel(x, packed)]
        return out + [cpu_kernels.gemv512(x[:rows], w) for rows in (1, 2, 8) if wide]

    runs = [run for five in at_thread_counts(lambda: [outputs() for _ in range(5)]) for run in five]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0], strict=True))


def test_decode_attention_is_deterministic_across_calls() -> None:
    """A request's key chunks are attended by whichever thread is free and merged by the one
    that finishes its last chunk, with no barrier in between: every merge must still see all of
    its chunks, in the same order, call after call."""
    torch.manual_seed(0)
    hq, hkv, d, slots = 8, 2, 64, 2048
    k_pool = torch.randn(slots, hkv, d).bfloat16()
    v_pool = torch.randn(slots, hkv, d).bfloat16()
    lens = torch.tensor([1, 65, 300, 1000, 17, 513, 128, 2000], dtype=torch.int64)
    table = torch.stack([torch.randperm(slots) for _ in range(len(lens))])
    q = torch.randn(len(lens), hq, d).bfloat16()
    first = cpu_kernels.decode_attention(q, k_pool, v_pool, table, lens, d**-0.5)
    for _ in range(30):
        again = cpu_kernels.decode_attention(q, k_pool, v_pool, table, lens, d**-0.5)
        assert torch.equal(again, first)
