"""Codes repacked once into 32-row panels (layers/csrc/qvpanel.c): `vnni_panel`, one kernel
for every row count, reading one contiguous run of memory per panel. Integer codes on
AVX512-VNNI: exact (x quantized per row to int16, as the decode GEMV does) or, under
--cpu-quantized-activations int8, with x rounded to 8 bits as x8_panel rounds it. fp8 e4m3
codes on AVX512-VBMI, against bf16 x only: each code looked up as its bf16 value (exact) and
multiplied with VDPBF16PS, or where the CPU lacks AVX512-BF16, split into fp32 for FMAs.

The panels hold the same bytes as the row-major codes, reordered: codes [N/32, K/4, 32]
dwords for 8-bit codes (four features of one row each), [N/32, K/8, 32] for 4-bit (eight),
[N/32, K/2, 32, 2] for fp8 (two features of one row, the rows of a line in FP8_ROW_ORDER);
scales and zero points [N/32, G, 32]. A packed weight keeps its tensors' shapes (codes
[N, K] or [N, K/2], scales [N, G]), so its memory, its huge pages and its QTensor views stay
as they were; only this kernel and the row lookups here read it (QuantWeight.packed says
so)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from minisgl import hugepages
from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_gemv, cpu_panel
from minisgl.quant.qtensor import QTensor, streamed

ROWS = 32  # weight rows per panel
# fp8: the row in each slot of a 64-byte line (two codes a slot): per 16-byte lane L rows
# 4L..4L+3, then 16+4L..16+4L+3, so the kernel's two byte unpacks give rows 0-15 and 16-31.
FP8_ROW_ORDER = [b + 4 * lane + i for lane in range(4) for b in (0, 16) for i in range(4)]
_FP8_SLOT = torch.tensor(FP8_ROW_ORDER).argsort()  # row r's slot in a line

# Where a weight keeps its packed copy for timing (packed_copy, pack_copies).
_COPY = "_vnni_packed"

logger = logging.getLogger(__name__)
# Whether the one-row form's L2 prefetch was measured in this process (_measure_row_prefetch).
_ROW_PREFETCH_MEASURED = False
# What that measure reads: more than a last-level cache's share holds warm, flushed anyway.
_ROW_PREFETCH_BYTES = 32 << 20
# Whether the many-row form's widening was measured in this process (_measure_wide_rows), at
# which row counts (fewest first) and on what weight shape.
_WIDE_ROWS_MEASURED = False
_WIDE_ROWS = (16, 32, 64)
_WIDE_SHAPE = (2048, 1024)


def takes(w: QTensor, x_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this build and CPU run vnni_panel for w against x of `x_dtype`: 8- or 4-bit
    integer codes, or fp8 codes against bf16 x, in contiguous groups of a multiple of 32
    features (8-bit codes also of 16: GGUF's Q6_K, Q3_K, Q2_K), N a multiple of 32 (ROWS)."""
    lib = cpu_kernels.load()
    if lib is None or lib.qvpanel_takes is None or w.g_idx is not None:
        return False
    kind = cpu_gemv.kind(w)
    if kind == "fp8" and x_dtype != torch.bfloat16:  # its products are bf16 pairs
        return False
    n, k = w.shape
    return kind in lib.qvpanel and bool(lib.qvpanel_takes(w.bits, n, k, w.group_size or k))


def takes_groups_of_16() -> bool:
    """Whether this build and CPU run 8-bit codes in groups of 16 (GGUF's Q6_K, Q3_K, Q2_K) in
    vnni_panel, the one kernel of this build that takes them (cpu_choice.takes_groups_of_16:
    builds without it run them row-major)."""
    lib = cpu_kernels.load()
    if lib is None or lib.qvpanel_takes is None or "u8" not in lib.qvpanel:
        return False
    return bool(lib.qvpanel_takes(8, ROWS, 256, 16))


def rounds_x_in_int8(w: QTensor) -> bool:
    """Whether --cpu-quantized-activations int8 rounds x for w: weights the C kernels' 8-bit
    path takes (cpu_gemv.takes_int8_activations), and integer codes only the panels take
    (8-bit codes in groups of 16: GGUF's Q6_K, Q3_K, Q2_K), whose x vnni_panel rounds as it
    does every integer weight's."""
    if cpu_gemv.takes_int8_activations(w):
        return True
    probe = torch.empty(1, w.in_features, dtype=torch.bfloat16)
    return cpu_gemv.kind(w) != "fp8" and takes(w) and not cpu_gemv.usable(probe, w)


def _panels(t: torch.Tensor, unit: int) -> torch.Tensor:
    """[..., N, X] -> the same elements as [..., N/ROWS, X/unit, ROWS, unit], flattened back
    to [..., N, X] (leading dims: several experts at once)."""
    *lead, n, x = t.shape
    out = t.reshape(*lead, n // ROWS, ROWS, x // unit, unit).transpose(-3, -2).contiguous()
    return out.reshape(t.shape)


def _fp8_panels(codes: torch.Tensor) -> torch.Tensor:
    """fp8 codes [..., N, K] -> [..., N/ROWS, K/2, ROWS (FP8_ROW_ORDER), 2], flattened back to
    [..., N, K]."""
    *lead, n, k = codes.shape
    b = codes.view(torch.uint8).reshape(*lead, n // ROWS, ROWS, k // 2, 2)
    b = b[..., FP8_ROW_ORDER, :, :]
    return b.transpose(-3, -2).contiguous().reshape(codes.shape).view(codes.dtype)


def _measure_row_prefetch() -> None:
    """Whether vnni_panel's one-row form prefetches its panels into L2 (qvpanel.c's
    vp_row_prefetch), measured once per process on the running machine: it reads the panels
    faster on some CPUs and slower on others. One row against 32 MB of 8-bit panels flushed
    from the caches, with and without, in turns, the best of 5 each; on only where it is 3%
    faster. The bits do not change, only the speed."""
    global _ROW_PREFETCH_MEASURED
    lib = cpu_kernels.load()
    if _ROW_PREFETCH_MEASURED or lib is None or lib.vp_row_prefetch is None:
        return
    _ROW_PREFETCH_MEASURED = True
    k = 2048
    n = _ROW_PREFETCH_BYTES // k
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    w = QTensor(codes, torch.ones(n, 1), torch.zeros(n, 1, dtype=torch.uint8), None, 8, 0, k)
    hugepages.move_all_onto(list(streamed(w)))  # as a model's packed weights lie
    x = torch.randn(1, k, dtype=torch.bfloat16)
    best = cpu_kernels.time_switch(lib.vp_row_prefetch, lambda: vnni_panel(x, w), streamed(w), 5)
    logger.info(
        "vnni_panel, one row: %s its L2 prefetch (%.1f GB/s with it, %.1f without)",
        "with" if lib.vp_row_prefetch.value else "without",
        _ROW_PREFETCH_BYTES / best[1] / 1e9,
        _ROW_PREFETCH_BYTES / best[0] / 1e9,
    )


def _measure_wide_rows() -> None:
    """From how many rows vnni_panel's exact form widens each chunk of a panel's codes once
    for all its row tiles (qvpanel.c's vp_wide_rows8 and vp_wide_rows4), per code width,
    measured once per process on the running machine: it pays where the products bound the
    loop, not where the codes' masks cost little beside the rest. At 16, 32 and 64 rows
    against 8-bit and 4-bit panels (2048x1024, groups of 128 with zero points, flushed from the
    caches), both ways in turns, the best of 4 each: from the fewest rows at which it and
    every larger count ran 3% faster; never where 64 did not. The bits do not change."""
    global _WIDE_ROWS_MEASURED
    lib = cpu_kernels.load()
    if _WIDE_ROWS_MEASURED or lib is None or not lib.vp_wide_rows:
        return
    _WIDE_ROWS_MEASURED = True
    n, k = _WIDE_SHAPE
    said = []
    for bits, switch in lib.vp_wide_rows.items():
        g = k // 128
        codes = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8)
        zeros = torch.randint(0, 1 << bits, (n, g), dtype=torch.uint8)
        w = _pack(QTensor(codes, torch.rand(n, g) / 64, zeros, None, bits, 128, k))
        ratios = []
        for rows in _WIDE_ROWS:
            run = partial(vnni_panel, torch.randn(rows, k, dtype=torch.bfloat16), w)
            best = cpu_kernels.time_switch(switch, run, streamed(w), 4)
            ratios.append(best[0] / best[1])
        start = 0
        for rows, ratio in zip(reversed(_WIDE_ROWS), reversed(ratios)):
            if ratio <= 1 / 0.97:
                break
            start = rows
        switch.value = start
        at = "/".join(f"{r:.2f}x" for r in ratios)
        said.append(f"{bits}-bit {f'from {start} rows' if start else 'never'} ({at})")
    logger.info(
        "vnni_panel, many rows: each chunk's codes widened once for all tiles: %s (speed at %s "
        "rows)",
        ", ".join(said),
        "/".join(map(str, _WIDE_ROWS)),
    )


def pack(w: QTensor) -> QTensor:
    """w's tensors in the panel layout (new tensors, but its group mins: row-major, shared; `w`
    is not changed). Its tensors may have leading dims (several experts' [E, N, X]: each
    packed as its own weight). The first in a process measures the one-row form's prefetch
    (_measure_row_prefetch) and the many-row form's widening (_measure_wide_rows)."""
    _measure_row_prefetch()
    _measure_wide_rows()
    return _pack(w)


def _pack(w: QTensor) -> QTensor:
    scales = _panels(w.scales, 1)
    if cpu_gemv.kind(w) == "fp8":
        return QTensor(
            _fp8_panels(w.codes), scales, None, None, w.bits, w.group_size, w.in_features
        )
    codes = _panels(w.codes, 4)  # a dword: 4 8-bit codes or 8 4-bit ones of one row
    zeros = _panels(w.zeros, 1) if w.zeros is not None else None
    # group mins stay row-major beside the panels (the same tensor), as a packed layer keeps them
    return replace(w, codes=codes, scales=scales, zeros=zeros, g_idx=None)


def _rows_of(t: torch.Tensor, unit: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a tensor _panels packed, in row-major order: [len(ids), X]."""
    n, x = t.shape
    panels = t.view(n // ROWS, x // unit, ROWS, unit)
    return panels[ids // ROWS, :, ids % ROWS].reshape(len(ids), x)


def take_rows(w: QTensor, ids: torch.Tensor) -> QTensor:
    """qtensor.take_rows for a packed weight: rows `ids` (any shape, flattened) gathered out of
    the panels as row-major codes, scales and zero points (an embedding lookup of a tied table
    that was packed for its LM head's matmul)."""
    flat = ids.reshape(-1)
    zeros = _rows_of(w.zeros, 1, flat) if w.zeros is not None else None
    scales = _rows_of(w.scales, 1, flat)
    if cpu_gemv.kind(w) == "fp8":
        n, k = w.codes.shape
        lines = w.codes.view(torch.uint8).view(n // ROWS, k // 2, ROWS, 2)
        codes = (
            lines[flat // ROWS, :, _FP8_SLOT[flat % ROWS]].reshape(len(flat), k).view(w.codes.dtype)
        )
    else:
        codes = _rows_of(w.codes, 4, flat)
    return QTensor(codes, scales, zeros, None, w.bits, w.group_size, w.in_features)


def dequant_rows(w: QTensor, ids: list[int]) -> torch.Tensor:
    """Rows `ids` of a packed weight as fp32 [len(ids), K], by C (a decode step's few
    lookups; the values qtensor.dequantize gives)."""
    lib = cpu_kernels.load()
    assert lib is not None
    ops = cpu_gemv.operands(w)
    out = torch.empty(len(ids), ops.k, dtype=torch.float32)
    fn = lib.qvpanel_rows[ops.kind]
    for r, i in enumerate(ids):
        fn(*ops.args, out[r].data_ptr(), i, i + 1, *ops.sizes[1:])
    return out


def packed_copy(w: QTensor) -> QTensor:
    """A packed copy of w kept with it (made by pack_copies, or here), for timing vnni_panel
    beside the row-major kernels (the chooser drops it with the views it timed)."""
    got = held_copy(w)
    if got is None:
        pack_copies([w])
        got = w.__dict__[_COPY]
    return got


def held_copy(w: QTensor) -> QTensor | None:
    """w's packed copy where pack_copies made one (None: none yet)."""
    got: QTensor | None = w.__dict__.get(_COPY)
    return got


def pack_copies(ws: list[QTensor]) -> None:
    """Packed copies of these weights, all on huge pages in one mapping as a model's packed
    weights are (loading.prepare_cpu): timed on small pages, a 4-bit 512x3072 call took 1.4x
    its time there."""
    new = [w for w in ws if _COPY not in w.__dict__]
    for w in new:
        w.__dict__[_COPY] = pack(w)
    hugepages.move_all_onto([t for w in new for t in streamed(w.__dict__[_COPY])])


def vnni_panel(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T -> [M, N] in `out_dtype` (default x's), w already packed."""
    lib = cpu_kernels.load()
    assert lib is not None
    kind = cpu_gemv.kind(w)
    if kind == "fp8" and x.dtype != torch.bfloat16:
        raise ValueError("fp8 panels multiply bf16 x only (cpu_vpanel.takes)")
    return cpu_panel.run_c(lib.qvpanel[kind], x, w, out_dtype)


def on_copy(run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`run` (a kernel over packed weights) on a row-major weight's packed copy: the chooser's
    candidates of the packed layout, timed beside the row-major kernels."""

    def timed(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return run(x, packed_copy(w), out_dtype)

    return timed


def takes_amx(w: QTensor) -> bool:
    """Whether amx_vpanel runs w's panels here: integer codes vnni_panel takes in groups of a
    multiple of 32, in a build and on a CPU with AMX-INT8 tiles granted (exact x, or under
    --cpu-quantized-activations int8 x in 8 bits as vnni_panel rounds it)."""
    lib = cpu_kernels.load()
    if lib is None or (w.group_size or w.in_features) % 32:  # its tiles' steps: 32 features
        return False
    return cpu_gemv.kind(w) in lib.qvpanel_amx and takes(w)


def amx_vpanel(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """vnni_panel's product on AMX-INT8 tiles (qvpanel.c's va_matmul): the same panels, the
    same bits (exact x, or x in 8 bits under --cpu-quantized-activations int8), faster from ~8
    rows (8-bit codes) or ~32 (4-bit) on an AMX Xeon."""
    lib = cpu_kernels.load()
    assert lib is not None
    return cpu_panel.run_c(lib.qvpanel_amx[cpu_gemv.kind(w)], x, w, out_dtype)


def takes_bf16(w: QTensor, x_dtype: torch.dtype) -> bool:
    """Whether amx_bf16_vpanel runs w's panels against x of `x_dtype` here: integer codes
    vnni_panel takes, bf16 x, a build with qamx.c's panel kernel (AMX tiles, or VDPBF16PS)."""
    lib = cpu_kernels.load()
    if lib is None or x_dtype != torch.bfloat16:
        return False
    return cpu_gemv.kind(w) in lib.qamx_packed and takes(w)


def amx_bf16_vpanel(
    x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x @ W.T for many rows over the packed panels: each panel dequantized once into bf16
    and multiplied by bf16 x (qamx.c: amx_panel's kernel and values, to the bit); fp32 x runs
    vnni_panel (the panel kernel takes bf16 x only)."""
    lib = cpu_kernels.load()
    assert lib is not None
    fn = lib.qamx_packed.get(cpu_gemv.kind(w)) if x.dtype == torch.bfloat16 else None
    return cpu_panel.run_c(fn, x, w, out_dtype) if fn else vnni_panel(x, w, out_dtype)
