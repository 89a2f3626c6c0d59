"""The CPU GEMV over quantized weights (csrc/qgemv.c) equals the dequantized weight's matmul,
for each kind of code (4-bit, 8-bit, fp8 e4m3 including its subnormals and signs), and a decode
step takes it instead of dequantizing a float copy of the weight."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers import cpu_kernels, kernel_choice
from minisgl.quant import cpu_gemv, cpu_panel, matmul
from minisgl.quant.attach import Regrouped, regrouped_line, x8_takes_4_bit
from minisgl.quant.qtensor import FP8, QTensor, dequantize, pack_nibbles
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")

N, K = 96, 512


@functools.cache
def _weights() -> dict[str, QTensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g)
    out = {m: quantize(w, load_scheme(m)) for m in ("int8", "int4", "fp8")}
    # Every e4m3 byte but NaN (0x7F, 0xFF), subnormals and negative zero included.
    codes = torch.arange(256, dtype=torch.uint8).repeat(N * K // 256).view(N, K)
    codes[codes % 128 == 127] = 0
    out["fp8 all codes"] = QTensor(codes.view(FP8), torch.rand(N, 4) + 0.5, None, None, 8, 128, K)
    # 4-bit, group 64 with random zero points (AWQ/GPTQ-like).
    q = torch.randint(0, 16, (N, K), generator=g)
    zeros = torch.randint(0, 16, (N, K // 64), generator=g).to(torch.uint8)
    out["int4 g64"] = QTensor(pack_nibbles(q), torch.rand(N, K // 64), zeros, None, 4, 64, K)
    return out


def _x_step(x: torch.Tensor) -> torch.Tensor:
    """Per input row, the step of the 16-bit integers the kernel multiplies integer codes by
    (max|x| / 32767): its rounding of x is at most half of it per feature."""
    return x.float().abs().amax(dim=1, keepdim=True) / 32767


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_the_dequantized_matmul(rows: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    for name, w in _weights().items():
        assert cpu_gemv.usable(x, w), name
        ours = cpu_gemv.qgemv(x, w)
        deq = dequantize(w, torch.float32)
        ref = F.linear(x.float(), deq)
        assert ours.dtype == dtype
        # Another summation order: off by rounding, relative to the size of the terms summed;
        # integer codes also by x's rounding to 16-bit integers (fp8 multiplies x as it is).
        terms = F.linear(x.float().abs(), deq.abs())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        x_err = _x_step(x) / 2 * deq.abs().sum(1) if w.codes.dtype != FP8 else 0
        assert bool(((ours.float() - ref).abs() <= tol * terms + x_err + 1e-6).all()), name


def _close(x: torch.Tensor, w: QTensor, ours: torch.Tensor) -> bool:
    """ours within test_gemv_equals_the_dequantized_matmul's bound of x @ dequantized w.T."""
    deq = dequantize(w, torch.float32)
    ref = F.linear(x.float(), deq)
    terms = F.linear(x.float().abs(), deq.abs())
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    x_err = _x_step(x) / 2 * deq.abs().sum(1) if w.codes.dtype != FP8 else 0
    return bool(((ours.float() - ref).abs() <= tol * terms + x_err + 1e-6).all())


def _random(kind: str, n: int, k: int, group: int, g: torch.Generator) -> QTensor:
    groups = k // group if group else 1
    scales = torch.rand(n, groups, generator=g) + 0.01
    if kind == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
        codes[codes % 128 == 127] = 0  # no NaN
        return QTensor(codes.view(FP8), scales, None, None, 8, group, k)
    top = 16 if kind == "int4" else 256
    q = torch.randint(0, top, (n, k), generator=g)
    zeros = torch.randint(0, top, (n, groups), generator=g).to(torch.uint8)
    codes = pack_nibbles(q) if kind == "int4" else q.to(torch.uint8)
    return QTensor(codes, scales, zeros, None, 4 if kind == "int4" else 8, group, k)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("group", [32, 64, 128, 0])
def test_every_group_size_and_row_count(kind: str, group: int) -> None:
    """Groups of 32 (4-bit: a 64-feature load would span two groups, another code path), 64,
    128 and a whole row, K not a multiple of the kernels' larger steps (K = 1056 = 33 x 32
    where the groups allow it), rows 1-5 and 9 (pairs, a last odd row; fp8 above two rows
    converts once per block), a weight whose rows are not a multiple of the 4-row block."""
    g = torch.Generator().manual_seed(group + len(kind))
    k = 1056 if group in (32, 0) else 1152
    w = _random(kind, 37, k, group, g)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            assert _close(x.to(dtype), w, cpu_gemv.qgemv(x.to(dtype), w)), (rows, dtype)


def test_8_bit_codes_in_groups_of_16() -> None:
    """8-bit codes in groups of 16 (GGUF's Q6_K, Q3_K, Q2_K, held so where the build has no VNNI
    panels): qgemv's steps of 32 features are two groups each, every row count (K = 1056 =
    33 steps, 37 weight rows: a last short block), each row to the same bits whether it
    shares a step's codes with another row or not (qgemv_g16_pairs), and the dequantizing
    kernels read them as qtensor.dequantize does. Called here in any build (only builds
    without the panels offer them the chooser)."""
    g = torch.Generator().manual_seed(16)
    w = _random("int8", 37, 1056, 16, g)
    lib = cpu_kernels.load()
    assert lib is not None
    assert cpu_gemv.takes_groups_of_16() == ("u8" not in lib.qvpanel)
    deq = dequantize(w, torch.float32)
    for rows in (1, 2, 3, 4, 5, 9, 40):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 1056, generator=g).to(dtype)
            ops = cpu_gemv.operands(w)
            ys = []
            for pairs in (1, 0):
                _switch("qgemv_g16_pairs").value = pairs
                y = torch.empty(rows, 37, dtype=torch.float32)
                try:
                    lib.qgemv["u8"](x.data_ptr(), int(dtype == torch.bfloat16), *ops.args,
                                    y.data_ptr(), 0, rows, *ops.sizes)  # fmt: skip
                finally:
                    _switch("qgemv_g16_pairs").value = 1
                assert _close(x, w, y), (rows, dtype, pairs)
                ys.append(y)
            assert torch.equal(ys[0], ys[1]), (rows, dtype)
            assert _close(x, w, cpu_panel.dequant_panel(x, w, torch.float32)), (rows, dtype)
    assert torch.equal(cpu_gemv.dequant_rows(w, 0, 37), deq)


def test_a_row_long_group_stops_at_the_row_end() -> None:
    """Per-channel 8-bit weights (one group per row) with K = 1536 (Qwen2.5-1.5B's hidden
    size): the kernel sums a long group 1024 features at a time, and the second chunk must
    end at K, not run 512 features past it into the next row's codes and past x."""
    g = torch.Generator().manual_seed(5)
    w = _random("int8", 8, 1536, 0, g)
    x = torch.randn(2, 1536, generator=g)
    assert _close(x, w, cpu_gemv.qgemv(x, w))


def test_fp8_subnormal_codes_survive_flush_denormal() -> None:
    """fp8 codes become fp32 subnormals inside the kernel: with torch.set_flush_denormal(True)
    (MXCSR's denormals-are-zero) they must still count."""
    k = 256
    codes = torch.tensor([1, 2, 3, 7, 0x81, 0x86], dtype=torch.uint8).repeat(4, k // 6 + 1)
    codes = codes[:, :k].contiguous()  # subnormal codes only: +-2^-9 .. 7 x 2^-9
    w = QTensor(codes.view(FP8), torch.ones(4, 2), None, None, 8, 128, k)
    x = torch.rand(3, k) + 0.5
    ref = F.linear(x, dequantize(w, torch.float32))
    assert bool(ref.abs().min() > 0.01)
    assert torch.set_flush_denormal(True)  # x86 with SSE3: every CPU the kernels build for
    try:
        got = [cpu_gemv.qgemv(x[:m], w) for m in (1, 3)]
    finally:
        torch.set_flush_denormal(False)
    for y in got:
        assert torch.allclose(y, ref[: y.shape[0]], rtol=1e-5, atol=0), y


def test_a_sliced_weight_is_read_in_place() -> None:
    """A tensor-parallel shard of the input features (codes and scales narrowed: strided rows)
    multiplies as the same shard copied out."""
    w = _weights()["int4 g64"]
    shard = w.narrow(1, 128, 256)
    assert not shard.codes.is_contiguous()
    copy = QTensor(
        shard.codes.contiguous(),
        shard.scales.contiguous(),
        shard.zeros.contiguous(),
        None,
        4,
        64,
        256,
    )
    for rows in (1, 3):  # one row: codes as bytes where the build has AVX512-VNNI
        x = torch.randn(rows, 256)
        assert torch.equal(cpu_gemv.qgemv(x, shard), cpu_gemv.qgemv(x, copy)), rows


def test_dequantized_rows_equal_the_reference_exactly() -> None:
    for name, w in _weights().items():
        assert torch.equal(cpu_gemv.dequant_rows(w, 8, 40), dequantize(w, torch.float32, 8, 40)), (
            name
        )


@pytest.mark.parametrize("path", [cpu_gemv.dequant_gemm, cpu_gemv.dequant_torch])
def test_prefill_paths_equal_the_dequantized_matmul(path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(cpu_gemv, "CHUNK_ELEMENTS", 32 * K)  # several chunks
    x = torch.randn(40, K)
    for name, w in _weights().items():
        deq = dequantize(w, torch.float32)
        ref = F.linear(x, deq)
        terms = F.linear(x.abs(), deq.abs())
        assert bool(((path(x, w) - ref).abs() <= 1e-5 * terms + 1e-6).all()), name


def test_decode_reads_the_codes_not_a_dequantized_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _weights()["int4"]

    def no_copy(*a, **k):
        raise AssertionError("dequantized a float copy for a decode-sized input")

    monkeypatch.setattr(matmul, "dequantize", no_copy)
    monkeypatch.setattr(cpu_gemv, "dequant_rows", no_copy)
    matmul.qlinear(torch.randn(1, K), w)
    with pytest.raises(AssertionError, match="float copy"):
        matmul.qlinear(torch.randn(cpu_kernels.MAX_ROWS + 1, K), w)  # prefill: dequantized


def test_measured_picks_dispatch_by_row_count(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The chooser times every candidate per bucket, caches the timings, and the kernel it
    builds runs each row count by its bucket's pick (not a fixed row limit)."""
    from minisgl.layers import kernel_choice
    from minisgl.quant import cpu_choice

    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_choice, "_MEMO", {})
    monkeypatch.setattr(cpu_choice, "_MAX_REPEATS", 2)  # quick: the picks are not the point
    ws = [_weights()["int8"]] * 2
    picks, source = cpu_choice.choose(ws, torch.float32, "full")
    assert source in (
        "measured",
        "measured beside other work",
        "defaults: timings disturbed, not cached",
    )
    assert len(picks) == len(kernel_choice.BUCKETS) and set(picks) <= set(cpu_choice.CANDIDATES)
    if source == "measured":
        monkeypatch.setattr(cpu_choice, "_MEMO", {})
        assert cpu_choice.choose(ws, torch.float32, "cached") == (picks, "cached")
    # Injected picks: one candidate for a single row, another for the rest (the table binds
    # the runs when the kernel is made: spies first).
    seen: list[str] = []
    for name in ("qgemv", "dequant_torch"):
        real = cpu_choice._RUN[name]
        monkeypatch.setitem(
            cpu_choice._RUN, name, lambda x, w, n=name, r=real: seen.append(n) or r(x, w)
        )
    kernel = cpu_choice.QuantKernel(
        ("dequant_torch",) + ("qgemv",) * (len(kernel_choice.BUCKETS) - 1)
    )
    kernel(torch.randn(1, K), ws[0])
    kernel(torch.randn(300, K), ws[0])
    assert seen == ["dequant_torch", "qgemv"]


def test_fused_moe_reads_only_the_routed_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized mixture's forward multiplies by the codes of the experts the router chose,
    and no other expert's bytes are touched."""
    from minisgl.layers.moe import FusedMoE
    from minisgl.quant.weight import QuantWeight

    e, h, inter = 8, 128, 64
    moe = FusedMoE(e, h, inter)
    scheme = load_scheme("int4")
    del moe.w13, moe.w2
    moe.w13 = QuantWeight(
        2 * inter, h, bits=4, fp8=False, group_size=128, groups=1, scattered_groups=False, experts=e
    )  # type: ignore[assignment]
    moe.w2 = QuantWeight(
        h, inter, bits=4, fp8=False, group_size=128, groups=1, scattered_groups=False, experts=e
    )  # type: ignore[assignment]
    g = torch.Generator().manual_seed(1)
    for i in range(e):
        moe.w13[i].copy_(quantize(torch.randn(2 * inter, h, generator=g), scheme))
    # w2's group (128) is longer than its 64 inputs: the torch path; w13 runs the C kernel.
    read: list[int] = []
    real = cpu_gemv.qgemv
    monkeypatch.setattr(
        cpu_gemv, "qgemv", lambda x, w, o=None: read.append(w.codes.data_ptr()) or real(x, w, o)
    )
    x = torch.randn(3, h)
    ids = torch.tensor([[5, 1], [1, 6], [6, 5]])
    weights = torch.full((3, 2), 0.5)
    moe.w2.codes.zero_(), moe.w2.scales.fill_(1.0), moe.w2.zeros.zero_()
    moe(x, weights, ids)
    assert sorted(read) == sorted(moe.w13.codes[i].data_ptr() for i in (1, 5, 6))


def test_a_source_added_to_the_build_is_a_new_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached library is keyed by the sources it compiles, not only by csrc's contents: a
    file added to the list (as qgemv.c was, while a build without it sat in the cache under
    the same contents) must not be served the old library, which lacks its functions."""
    from minisgl.layers import cpu_build

    before = cpu_build.source_digest("avx2", ["-mavx2"])
    monkeypatch.setattr(cpu_build, "COMMON_SOURCES", cpu_build.COMMON_SOURCES[:-1])
    assert cpu_build.source_digest("avx2", ["-mavx2"]) != before


def _switch(name: str) -> ctypes.c_int:
    """One of qgemv.c's switches: qgemv_byte_path (one row of x as bytes: 1, as int16: 0),
    qgemv_gfni (4-bit codes split with GFNI: 1, without: 0, -1: as the CPU has it)."""
    assert cpu_kernels._LIB_PATH is not None
    return ctypes.c_int.in_dll(ctypes.CDLL(str(cpu_kernels._LIB_PATH)), name)


def _exact(x: torch.Tensor, q: torch.Tensor, w: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w.T with x quantized per row as the kernel does (the same fp32 operations, round to
    nearest even) and every integer sum exact (float64), and the size of the terms summed."""
    xf = x.float()
    step = xf.abs().amax(dim=1, keepdim=True) / 32767
    step = torch.where(step > 0, step, torch.ones_like(step))
    xq = torch.round(xf * (1 / step)).clamp(-32767, 32767).double()
    gs = w.group_size or w.in_features
    n, k = q.shape
    codes = q.double().view(n, k // gs, gs)
    xg = xq.view(-1, 1, k // gs, gs)
    sums = (xg * codes).sum(-1)  # [rows, n, groups], exact
    zero = w.zeros.double() * xg.sum(-1) if w.zeros is not None else 0
    scale = w.scales.double()
    y = step.double() * (scale * (sums - zero)).sum(-1)
    terms = step.double() * (scale.abs() * ((xg.abs() * codes).sum(-1) + abs(zero))).sum(-1)
    return y, terms


@pytest.mark.parametrize(
    "bits, k, group",
    [
        (8, 1536, 0),  # per channel: chunks of 768 features
        (8, 2560, 0),  # chunks of 512
        (8, 1024, 32),  # groups shorter than a step: a scale per lane
        (8, 1024, 64),
        (8, 1152, 128),
        (4, 1536, 0),
        (4, 1024, 32),
        (4, 1024, 64),
        (4, 1152, 128),
        (4, 1024, 256),
        (4, 1152, 96),  # no byte layout: the int16 path
        (8, 1056, 0),  # K not a multiple of a step: the int16 path
    ],
)
def test_one_row_sums_exactly_as_bytes_and_as_int16(bits: int, k: int, group: int) -> None:
    """One input row against integer codes: split into bytes for VPDPBUSD where the build has
    AVX512-VNNI, as int16 elsewhere; either way the integer sums are exact, so the result is
    the exact sum but for fp32 roundings. x reaches +-max|x| (codes +-32767: high bytes -128
    and 127, low bytes 1 and 255), codes reach 0 and their top, zero points are random."""
    g = torch.Generator().manual_seed(bits * 7 + k + group)
    n, top = 37, (1 << bits) - 1
    q = torch.randint(0, top + 1, (n, k), generator=g)
    q[0, : k // 2], q[1, : k // 2] = 0, top
    groups = k // group if group else 1
    zeros = torch.randint(0, top + 1, (n, groups), generator=g).to(torch.uint8)
    scales = torch.rand(n, groups, generator=g) + 0.01
    codes = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    w = QTensor(codes, scales, zeros, None, bits, group, k)
    x = torch.randn(1, k, generator=g)
    x[0, ::7], x[0, 3::11] = 3.0, -3.0  # both ends of the int16 range, many times
    x[0, 5::13] = 1e-4  # quantized to small integers
    byte_path, gfni = _switch("qgemv_byte_path"), _switch("qgemv_gfni")
    cpu_gemv.qgemv(x, w)  # gfni: from -1 to what the CPU has
    paths = [(1, gfni.value), (1, 0), (0, 0)]  # bytes (with GFNI where the CPU has it), int16
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref, terms = _exact(xd, q, w)
        got = {}
        for path in paths:
            saved = byte_path.value, gfni.value
            byte_path.value, gfni.value = path
            try:
                got[path] = cpu_gemv.qgemv(xd, w, torch.float32).double()
            finally:
                byte_path.value, gfni.value = saved
        for path, y in got.items():
            assert bool(((y - ref).abs() <= 1e-5 * terms).all()), (dtype, path)


@pytest.mark.parametrize(
    "bits, k, group",
    [
        (8, 1536, 0),
        (8, 2560, 0),
        (8, 1024, 32),
        (8, 1024, 64),
        (8, 1152, 128),
        (4, 1536, 0),
        (4, 1024, 32),
        (4, 1024, 64),
        (4, 1152, 128),
        (4, 1024, 256),
    ],
)
def test_integer_rows_sum_alike_at_every_batch_size(bits: int, k: int, group: int) -> None:
    """Integer codes against a decode batch: each row of x gets the same bits whatever rows
    share its call, up to 16 rows (the byte path multiplies them all where the build has
    AVX512-VNNI; before, 2 and more rows took the int16 paths, whose fp32 roundings differ
    from one row's), and the exact sum but for fp32 roundings at every row count; one row
    of 8-bit codes reads a block's rows one chunk at a time or a line of each in turn
    (qgemv_rows_seq), and one row of 4-bit codes in groups of 128 takes its own loop or the
    general one (qgemv_one_row_u4), to the same bits."""
    g = torch.Generator().manual_seed(bits + k + group)
    n, top = 45, (1 << bits) - 1
    q = torch.randint(0, top + 1, (n, k), generator=g)
    q[0, : k // 2], q[1, : k // 2] = 0, top
    groups = k // group if group else 1
    zeros = torch.randint(0, top + 1, (n, groups), generator=g).to(torch.uint8)
    scales = torch.rand(n, groups, generator=g) + 0.01
    codes = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    w = QTensor(codes, scales, zeros, None, bits, group, k)
    x = torch.randn(17, k, generator=g)
    x[:, ::7], x[:, 3::11] = 3.0, -3.0
    lib = ctypes.CDLL(str(cpu_kernels._LIB_PATH))
    byte_rows = getattr(lib, "qgemv_bytes_rows", None) is not None
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref, terms = _exact(xd, q, w)
        one = torch.cat([cpu_gemv.qgemv(xd[i : i + 1], w, torch.float32) for i in range(17)])
        assert bool(((one.double() - ref).abs() <= 1e-5 * terms).all()), dtype
        for name in ("qgemv_rows_seq", "qgemv_one_row_u4") if byte_rows else ():
            switch = _switch(name)
            switch.value = 0
            try:
                other = torch.cat(
                    [cpu_gemv.qgemv(xd[i : i + 1], w, torch.float32) for i in range(17)]
                )
            finally:
                switch.value = 1
            assert torch.equal(other, one), (dtype, name)
        for rows in (2, 3, 4, 7, 8, 16, 17):
            y = cpu_gemv.qgemv(xd[:rows], w, torch.float32)
            assert bool(((y.double() - ref[:rows]).abs() <= 1e-5 * terms[:rows]).all()), rows
            if byte_rows and rows <= 16:
                assert torch.equal(y, one[:rows]), (dtype, rows)


def _x8_chunk(bits: int, k: int, gs: int) -> int:
    """The features a chunk of the AVX512-VNNI 8-bit activation path spans (qgemv.c's
    bytes_chunks): a step (64 features for 8-bit codes, 128 for 4-bit) where groups are
    shorter, else a group's equal parts of whole steps, at most 1024 features."""
    step = 64 if bits == 8 else 128
    if gs < step:
        return step
    n = -(-gs // 1024)
    while gs % n or (gs // n) % step:
        n += 1
    return gs // n


def _exact_x8v(
    x: torch.Tensor, q: torch.Tensor, w: QTensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x @ w.T as --cpu-quantized-activations int8 computes it with AVX512-VNNI: x rounded to
    8 bits per block of features (max|x| / 127, round to nearest even, the same fp32
    operations), a block being the features one lane of the kernel's 16 sums holds over a
    chunk (8-bit codes: features 4l..4l+3 of each 64, 4-bit: 8l..8l+7 of each 128, l the
    lane), every integer sum exact (float64); the size of the terms summed; and each
    feature's rounding bound (half its block's step)."""
    n, k = q.shape
    gs = w.group_size or k
    step_f = 64 if w.bits == 8 else 128
    chunk = _x8_chunk(w.bits, k, gs)
    f = torch.arange(k)
    block = (f // chunk) * 16 + (f % step_f) // (step_f // 16)
    order = torch.argsort(block, stable=True)  # each block's features contiguous
    per = k // (16 * (k // chunk))
    xb = x.float()[:, order].view(x.shape[0], -1, per)
    step = xb.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    xq = torch.round(xb * (1 / step)).clamp(-127, 127).double()  # [rows, blocks, per]
    codes = q.double()[:, order].view(n, -1, per)
    steps = step.double().squeeze(-1).unsqueeze(1)  # [rows, 1, blocks]
    group = order.view(-1, per)[:, 0] // gs  # each block's group
    scale = w.scales.double()[:, group]  # [n, blocks]
    sums = (xq.unsqueeze(1) * codes).sum(-1) * steps
    y = (scale * sums).sum(-1)
    terms = (scale.abs() * (xq.abs().unsqueeze(1) * codes).sum(-1) * steps).sum(-1)
    if w.zeros is not None:
        zero = w.zeros.double()[:, group] * (xq.sum(-1).unsqueeze(1) * steps)
        y = y - (scale * zero).sum(-1)
        terms = terms + (scale.abs() * zero.abs()).sum(-1)
    half = torch.empty(x.shape[0], k)
    half[:, order] = (step / 2).expand_as(xb).reshape(x.shape[0], k)
    return y, terms, half


def _exact_x8(x: torch.Tensor, q: torch.Tensor, w: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w.T as --cpu-quantized-activations int8 computes it without AVX512-VNNI: x rounded to 8 bits per block of
    128 features (64 where groups are 32 or 64 long; max|x| / 127, the same fp32 operations,
    round to nearest even), every integer sum exact (float64); and the size of the terms
    summed."""
    n, k = q.shape
    gs = w.group_size or k
    xb = 128 if gs % 128 == 0 else 64
    blocks = x.float().view(-1, k // xb, xb)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    xq = torch.round(blocks * (1 / step)).clamp(-127, 127).double()  # [rows, blocks, xb]
    part = min(xb, gs)  # groups of 32: two a block, each with its own scale
    xq = xq.reshape(-1, k // part, part)
    codes = q.double().view(n, k // part, part)
    steps = step.double().repeat_interleave(xb // part, dim=1).view(-1, 1, k // part)
    sums = (xq.unsqueeze(1) * codes).sum(-1) * steps
    group = torch.arange(k // part) * part // gs  # each part's group
    scale = w.scales.double()[:, group]  # [n, parts]
    y = (scale * sums).sum(-1)
    terms = (scale.abs() * (xq.abs().unsqueeze(1) * codes).sum(-1) * steps).sum(-1)
    if w.zeros is not None:
        xsum = xq.sum(-1).unsqueeze(1) * steps  # [rows, 1, parts]
        zero = w.zeros.double()[:, group] * xsum
        y = y - (scale * zero).sum(-1)
        terms = terms + (scale.abs() * zero.abs()).sum(-1)
    return y, terms


def test_start_up_log_names_the_groups_8_bit_x_leaves_exact() -> None:
    """The tensor-parallel regrouping line names the weights --cpu-quantized-activations int8
    leaves exact by attach.x8_takes_4_bit, the running build's own rule (qgemv_x8_takes) over
    rank shares and groups tensor parallelism makes. Before, the rule said "without
    AVX512-VNNI" and the VNNI build's said it took no 4-bit rows of 1088 inputs in groups of
    32 while its kernel rounded x for them."""
    lib = cpu_kernels.load()
    assert lib is not None
    if lib.qgemv_x8_rows:  # an AVX-512 build without VNNI takes none (the loader says so)
        for k in (64, 96, 128, 192, 256, 384, 640, 1024, 1088, 1536, 3072):
            for g in (32, 64, 96, 128, 192, 256, 384, 512):
                assert bool(lib.qgemv_x8_takes(4, k, g)) == x8_takes_4_bit(k, g), (k, g)
    tp8 = Regrouped("experts' down_proj", 768, 96, 128, 32)
    line = regrouped_line([tp8] * 48, load_scheme("int4"))
    assert line.endswith("it leaves experts' down_proj (96 inputs in groups of 32) exact")
    tp4 = Regrouped("experts' down_proj", 768, 192, 128, 64)  # groups of 64: taken
    assert "leaves" not in regrouped_line([tp4] * 48, load_scheme("int4"))


@pytest.mark.parametrize(
    "k, group", [(1536, 0), (1024, 64), (1152, 128), (1024, 256), (1024, 32), (1088, 32)]
)
def test_int4_against_x_in_8_bits(k: int, group: int) -> None:
    """--cpu-quantized-activations int8 (qgemv_x8): x against 4-bit codes in decode batches (1 to
    64 rows) is x rounded to 8 bits per 128 features (64 in groups of 32 or 64: Q4_0 and Q4_K
    files' groups of 32 two to a block, each with its own scale), times the codes, summed
    exactly: the same result as that reference but for fp32 roundings, and within x's
    rounding (half a step a feature) of the float matmul. Prefill (more rows) and the switch
    off: exact to 15-bit x as before. Where the build has AVX512-VNNI x's blocks are those of
    its lanes (_exact_x8v); rows of inputs that are not whole steps of 128 (1088) there take
    the blocks of the build without it (before, qgemv_x8_takes said they stayed exact)."""
    g = torch.Generator().manual_seed(k + group)
    n = 37
    q = torch.randint(0, 16, (n, k), generator=g)
    q[0, : k // 2], q[1, : k // 2] = 0, 15
    groups = k // group if group else 1
    zeros = torch.randint(0, 16, (n, groups), generator=g).to(torch.uint8)
    scales = torch.rand(n, groups, generator=g) + 0.01
    w = QTensor(pack_nibbles(q), scales, zeros, None, 4, group, k)
    x = torch.randn(3, k, generator=g)
    x[:, ::7], x[:, 3::11] = 3.0, -3.0  # codes +-127
    x[:, 5::13] = 1e-4  # rounded to 0
    x[:, 128:256] = 0.0  # an all-zero block
    deq = dequantize(w, torch.float32)
    most = cpu_kernels.x8_gemv_rows()  # the GEMV's rows (qvnni.c takes more)
    vnni = cpu_kernels.isa() == "avx512" and "avx512_vnni" in _flags()
    assert most == 64
    assert cpu_gemv.takes_8_bit_codes() == vnni
    assert cpu_gemv.takes_int8_activations(w) and x8_takes_4_bit(k, group or k)
    gs = group or k  # VNNI's lanes take whole steps of 128 features (qgemv.c's x8v_takes)
    vnni = vnni and k % 128 == 0 and (gs % 128 == 0 or 128 % gs == 0)

    def reference(xr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _exact_x8v(xr, q, w)[:2] if vnni else _exact_x8(xr, q, w)

    cpu_kernels.set_quantized_activations("int8")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            one = cpu_gemv.qgemv(xd[:1], w, torch.float32).double()
            ref, terms = reference(xd[:1])
            assert bool(((one - ref).abs() <= 1e-5 * terms).all()), dtype
            if vnni:
                half = _exact_x8v(xd[:1], q, w)[2]
            else:
                blocks = xd[:1].float().view(1, -1, 128 if (group or k) % 128 == 0 else 64)
                half = (blocks.abs().amax(-1, keepdim=True) / 254).expand_as(blocks)
            rounding = F.linear(half.reshape(1, k), deq.abs()).double()
            exact = F.linear(xd[:1].float(), deq).double()
            assert bool(((one - exact).abs() <= rounding * 1.001 + 1e-4).all()), dtype
            assert not torch.equal(one, exact)  # x was rounded: the switch took effect
            if vnni:  # a row's bits whatever rows share its call (one row: its own loop)
                rows3 = cpu_gemv.qgemv(xd, w, torch.float32)
                for i in range(3):
                    alone = cpu_gemv.qgemv(xd[i : i + 1], w, torch.float32)
                    assert torch.equal(rows3[i], alone[0]), (dtype, i)
            for rows in (1, 2, 3, 16, 64, 65):  # in pairs; past 64 rows exact
                xr = xd.repeat(-(-rows // 3), 1)[:rows]
                got = cpu_gemv.qgemv(xr, w, torch.float32).double()
                ref, terms = reference(xr) if rows <= most else _exact(xr, q, w)
                assert bool(((got - ref).abs() <= 1e-5 * terms).all()), (dtype, rows)
    finally:
        cpu_kernels.set_quantized_activations("int16")
    assert cpu_kernels.quantized_activations() == "int16"
    ref16, terms16 = _exact(x[:1], q, w)
    off = cpu_gemv.qgemv(x[:1], w, torch.float32).double()
    assert bool(((off - ref16).abs() <= 1e-5 * terms16).all())


@pytest.mark.parametrize(
    "k, group, zeros",
    [(1024, 0, False), (3072, 0, False), (1536, 0, True), (1024, 128, True), (1024, 32, True)],
)
def test_int8_weights_against_x_in_8_bits(k: int, group: int, zeros: bool) -> None:
    """--cpu-quantized-activations int8 on 8-bit weights (--quantization int8: per channel,
    zero point 128; 8-bit GPTQ: groups, zero points): with AVX512-VNNI, 1 to 16 rows of x (and
    64) are x rounded to 8 bits per block of at most 64 features (_exact_x8v) times the codes,
    summed exactly: within fp32 roundings of that reference, and within x's rounding (half a
    step a feature) of the float matmul; each row's result the same bits whatever rows are
    batched with it. Without VNNI 8-bit codes stay exact (the switch does not take them; the
    exact paths' rows may differ in their last bits with the batch there)."""
    g = torch.Generator().manual_seed(k + group)
    n = 45
    q = torch.randint(0, 256, (n, k), generator=g)
    q[0], q[1, : k // 2] = 255, 0
    groups = k // group if group else 1
    zero = (
        torch.randint(0, 256, (n, groups), generator=g) if zeros else torch.full((n, groups), 128)
    ).to(torch.uint8)
    w = QTensor(q.to(torch.uint8), torch.rand(n, groups, generator=g) * 1e-2, zero, None, 8,
                group, k)  # fmt: skip
    deq = dequantize(w, torch.float32).double()
    x = torch.randn(16, k, generator=g)
    x[:, ::7], x[:, 3::11] = 3.0, -3.0  # codes +-127
    x[:, 64:128] = 0.0  # all-zero blocks
    x[3, 200] = 40.0  # an outlier: its block alone is coarser
    takes = cpu_gemv.takes_int8_activations(w)
    assert takes == cpu_gemv.takes_8_bit_codes()
    cpu_kernels.set_quantized_activations("int8")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            alone = [cpu_gemv.qgemv(xd[i : i + 1], w, torch.float32) for i in range(16)]
            for rows in range(1, 17) if takes else ():
                got = cpu_gemv.qgemv(xd[:rows], w, torch.float32)
                for i in range(rows):  # batch independence: bit for bit
                    assert torch.equal(got[i], alone[i][0]), (dtype, rows, i)
            got = torch.cat(alone).double()
            float_ref = xd.double() @ deq.T
            if not takes:
                ref, terms = _exact(xd, q, w)
                assert bool(((got - ref).abs() <= 1e-5 * terms).all()), dtype
                continue
            ref, terms, half = _exact_x8v(xd, q, w)
            assert bool(((got - ref).abs() <= 1e-5 * terms).all()), dtype
            rounding = half.double() @ deq.abs().T
            assert bool(((got - float_ref).abs() <= rounding * 1.001 + 1e-5).all()), dtype
            assert not torch.equal(got, _exact(xd, q, w)[0].float().double())
            # half a percent of the terms' size: the tolerance docs/models.md states
            size = xd.double().abs() @ deq.abs().T
            assert bool(((got - float_ref).abs() <= 5e-3 * size).all()), dtype
            for rows in (64, 65):  # 64 rows rounded; past 64 (prefill) exact again
                xr = xd.repeat(rows // 16 + 1, 1)[:rows]
                y = cpu_gemv.qgemv(xr, w, torch.float32).double()
                ref, terms = _exact_x8v(xr, q, w)[:2] if rows <= 64 else _exact(xr, q, w)
                assert bool(((y - ref).abs() <= 1e-5 * terms).all()), (dtype, rows)
    finally:
        cpu_kernels.set_quantized_activations("int16")


def _flags() -> frozenset[str]:
    from minisgl.layers import cpu_build

    return cpu_build.cpu_info()[1]


def _timings_taken(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    states: Sequence[object],
    enter: Callable[[Any], object],
) -> list[object]:
    """The quantized chooser asked for int4 picks once in each of `states` (enter(state) sets
    one up) within one process: the states whose picks were timed, not taken from memory."""
    from minisgl.quant import cpu_choice

    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_choice, "_MEMO", {})
    timed: list[object] = []
    fake = {name: [1.0] * len(kernel_choice.BUCKETS) for name in cpu_choice.CANDIDATES}
    now: list[object] = [None]
    monkeypatch.setattr(cpu_choice, "measure", lambda *a, **k: timed.append(now[0]) or fake)
    ws = [_weights()["int4"]]
    for state in states:
        enter(state)
        now[0] = state
        cpu_choice.choose(ws, torch.bfloat16, "full")
    return timed


def test_picks_are_timed_again_for_8_bit_activations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--cpu-quantized-activations changes what integer matmuls cost: a model loaded in one mode does
    not reuse the picks timed in the other, in memory (one process, e.g. a benchmark with both)
    or on disk (the tuning cache's key)."""
    from minisgl.quant import cpu_choice

    try:
        modes = ("int16", "int8", "int16", "int8")
        timed = _timings_taken(tmp_path, monkeypatch, modes, cpu_kernels.set_quantized_activations)
    finally:
        cpu_kernels.set_quantized_activations("int16")
    assert timed == ["int16", "int8"]  # once per mode; then from memory
    keys = {cpu_choice.machine_key().digest()}
    cpu_kernels.set_quantized_activations("int8")
    try:
        keys.add(cpu_choice.machine_key().digest())
    finally:
        cpu_kernels.set_quantized_activations("int16")
    assert len(keys) == 2


def test_picks_are_timed_again_at_another_thread_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that changes its thread count (torch.set_num_threads, as the benchmarks'
    --threads does) times again: picks timed on 2 threads are not those of 1. Before, the
    in-memory picks were keyed without it and reused."""
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    try:
        counts = (threads, other, threads, other)
        timed = _timings_taken(tmp_path, monkeypatch, counts, torch.set_num_threads)
    finally:
        torch.set_num_threads(threads)
    assert timed == [threads, other]  # once per thread count; then from memory


def _scripted_quant_kernels(
    monkeypatch: pytest.MonkeyPatch, burst: float
) -> tuple[Callable[[], float], dict[str, int]]:
    """cpu_choice's candidates on a fake clock (returned, with each one's call count):
    dequant_panel 6 s a pass but `burst` s over its warm-up and first 3 passes (other work on
    the machine), qgemv 7 s throughout, every other 100 s. The counts are shared by every row
    count's passes, so only the first row count's are in the burst."""
    from minisgl.quant import cpu_choice

    now = [0.0]
    passes: dict[str, int] = {}

    def scripted(name: str) -> Callable[..., None]:
        def run(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> None:
            passes[name] = passes.get(name, 0) + 1
            if name == "dequant_panel":
                now[0] += burst if passes[name] <= 4 else 6.0
            else:
                now[0] += 7.0 if name == "qgemv" else 100.0

        return run

    for name in cpu_choice.CANDIDATES:
        monkeypatch.setitem(cpu_choice._RUN, name, scripted(name))
    return lambda: now[0], passes


def test_a_kernel_near_the_leader_is_timed_again_before_it_loses_the_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default leads (7 s a pass) while the truly faster kernel (6 s) has every one of its
    first passes in a burst of other work (8 s): within kernel_choice.CONFIRM_WITHIN of the
    leader, it takes more passes in turn with it and is picked. Before, only a default that
    was not the leader was timed again, and the slower default kept the bucket."""
    from minisgl.quant import cpu_choice

    clock, _ = _scripted_quant_kernels(monkeypatch, burst=8.0)
    defaults = ("qgemv",) * len(kernel_choice.BUCKETS)
    timings = cpu_choice.measure(
        [_weights()["int4"]], torch.float32, clock=clock, defaults=defaults
    )
    # every row count's passes share the script's counter: only the first is a burst
    assert timings["dequant_panel"][0] == 6.0
    assert kernel_choice.pick(timings, defaults)[0] == "dequant_panel"


def test_a_burst_over_the_defaults_first_passes_does_not_pick_a_slower_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Timings of a shared machine: the default kernel's first passes land in a burst of other
    work (10 s a pass instead of 6) while another kernel takes 7 s a pass throughout. The
    leader is timed again in turn with the default, so the default (the faster) stays the pick;
    before, the slower kernel was picked."""
    from minisgl.quant import cpu_choice

    clock, passes = _scripted_quant_kernels(monkeypatch, burst=10.0)
    defaults = ("dequant_panel",) * len(kernel_choice.BUCKETS)
    ws = [_weights()["int4"]]
    for confirm, want in ((0, "qgemv"), (kernel_choice.CONFIRM_REPEATS, "dequant_panel")):
        monkeypatch.setattr(kernel_choice, "CONFIRM_REPEATS", confirm)
        passes.clear()
        timings = cpu_choice.measure(ws, torch.float32, clock=clock, defaults=defaults)
        # every row count's passes share the script's counter: only the first is a burst
        assert kernel_choice.pick(timings, defaults)[0] == want, confirm
