"""Quantized weights whose groups carry a float min (GGUF's Q4_K / Q5_K: weight = d * sc * q -
dmin * m): every way minisgl reads such a weight gives the values qtensor.dequantize gives (and
gguf-py's reference dequantizer, tests/engine/test_gguf.py): tensor-parallel cuts, embedding
rows, the CPU kernels with the mins' term after them, VNNI panels, and the GPU conversions
(through torch's CPU twins of its int4 ops)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from quant_parity import needs_vnni_panel
from torch import nn

from minisgl.layers import cpu_chain, cpu_kernels
from minisgl.layers.kernel_choice import TIMED_ROWS
from minisgl.quant import cpu_choice, cpu_gemv, cpu_panel, cpu_vpanel, formats
from minisgl.quant import cuda_matmul as cm
from minisgl.quant.matmul import through
from minisgl.quant.qtensor import QTensor, dequantize, take_rows, without_mins
from minisgl.quant.scheme import parse_quantization_config
from minisgl.quant.weight import QuantWeight
from minisgl.testing.gguf_requantize import quantize


def _k_weight(kind: str, n: int = 96, k: int = 512, seed: int = 0) -> QTensor:
    rng = np.random.default_rng(seed)
    # each row off zero by its own amount: mins far from a whole number of scales
    values = rng.standard_normal((n, k)) * 0.05 + rng.uniform(-0.1, 0.1, (n, 1))
    blocks = quantize(values.astype(np.float32), kind)
    scheme = parse_quantization_config({"quant_method": "gguf", "modules": {"x": kind}})
    assert scheme is not None
    return formats.read_linear("x", {"weight": torch.from_numpy(blocks)}, scheme)


def _holder(w: QTensor, experts: int = 0, compact: bool = True) -> QuantWeight:
    """A layer's buffers filled with w (each expert's), its mins compact where w's are and
    `compact`, else float32."""
    n, k = w.shape
    h = QuantWeight(
        n, k, bits=w.bits, fp8=False, group_size=w.group_size, groups=w.scales.shape[1],
        scattered_groups=False, experts=experts, mins=True,
        mins_per=w.mins_per if compact else 0,
    )  # fmt: skip
    for e in range(max(experts, 1)):
        (h.view(e) if experts else h.view()).copy_(w)
    return h


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_tensor_parallel_cuts_and_rows_keep_each_weights_min(kind: str) -> None:
    w = _k_weight(kind)
    full = dequantize(w, torch.float32)
    assert torch.equal(dequantize(w.narrow(0, 32, 40), torch.float32), full[32:72])
    assert torch.equal(dequantize(w.narrow(1, 256, 256), torch.float32), full[:, 256:])
    assert w.narrow(1, 256, 256).mins_per == 8  # whole super-blocks: the mins stay compact
    inside = w.narrow(1, 128, 256)  # half a super-block each side: float32 mins
    assert inside.mins_per == 0 and inside.mins is not None and inside.mins.dtype == torch.float32
    assert torch.equal(dequantize(inside, torch.float32), full[:, 128:384])
    # a cut inside a group of 32 (regrouped into groups of 16, each keeping its min)
    cut = w.narrow(1, 16, 48)
    assert cut.group_size == 16
    assert torch.equal(dequantize(cut, torch.float32), full[:, 16:64])
    ids = torch.tensor([5, 0, 95])
    assert torch.equal(dequantize(take_rows(w, ids), torch.float32), full[ids])


def test_a_layers_buffers_take_mins_only_from_a_weight_that_has_them() -> None:
    w = _k_weight("Q4_K")
    h = _holder(w)
    assert torch.equal(dequantize(h.view(), torch.float32), dequantize(w, torch.float32))
    plain = QTensor(w.codes, w.scales, w.zeros, None, 4, 32, w.in_features)
    with pytest.raises(ValueError, match="mins"):
        h.copy_(plain)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_and_the_mins_term_give_the_dequantized_product(
    kind: str, rows: int, dtype: torch.dtype
) -> None:
    """qgemv (up to 16 rows) and the dequantized chunks (more) over the codes, scales and zero
    points, less sum_g min * sum of x over g: the product of the dequantized weight."""
    h = _holder(_k_weight(kind))
    ref_w = dequantize(h.view(), torch.float32)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    ref = x.float() @ ref_w.t()
    y = h.matmul(x)
    assert y.dtype == dtype
    tol = 3e-4 if dtype == torch.float32 else 1e-2  # qgemv rounds x to 16 bits a row
    assert (y.float() - ref).norm() / ref.norm() < tol
    logits = h.matmul(x, torch.float32)  # an LM head's float32 logits
    assert logits.dtype == torch.float32
    assert (logits - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_x_in_8_bits_then_the_mins_term(kind: str) -> None:
    """--cpu-quantized-activations int8 on a K-quant weight: where the kernels take its codes
    (Q4_K's 4-bit codes in groups of 32 in either build, two groups to a block of x on AVX2;
    Q5_K's 8-bit codes only with AVX512-VNNI) x is rounded to 8 bits a block, and the mins'
    term comes after as before: within half a percent of the terms' size of the dequantized
    product (docs/models.md), and no longer the exact result; codes it does not take stay
    exact."""
    if cpu_kernels.load() is None:
        pytest.skip("no C kernels here: nothing rounds x")
    h = _holder(_k_weight(kind))
    ref_w = dequantize(h.view(), torch.float32).double()
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5))
    exact = h.matmul(x, torch.float32)
    cpu_kernels.set_quantized_activations("int8")
    try:
        y = h.matmul(x, torch.float32)
    finally:
        cpu_kernels.set_quantized_activations("int16")
    size = x.double().abs() @ ref_w.abs().T
    assert bool(((y.double() - x.double() @ ref_w.T).abs() <= 5e-3 * size).all())
    taken = cpu_gemv.takes_int8_activations(h.view())
    assert taken == (kind == "Q4_K" or cpu_gemv.takes_8_bit_codes())
    assert torch.equal(y, exact) != taken


@pytest.mark.parametrize("n, k", [(37, 1088), (64, 1024), (19, 96)])
def test_the_mins_term_is_each_rows_own_whatever_rows_share_the_call(n: int, k: int) -> None:
    """csrc/qmins.c: acc - sum_g min[n, g] * (x's sum over group g), within fp32 roundings of
    the float64 sum, and a row's bits the same alone (its row-by-row loop) as among 2-140 rows
    (eight rows of mins at a time, one reduction for the eight; the rows of x in runs of 64,
    the last one short): rows of mins past a multiple of 8 (37, 19) and groups past one (34
    groups of 32 for K = 1088, 3 for 96) included; into bf16, each the float32 result rounded
    to the nearest (an eight-row block's eight as one vector, the rest one by one). The
    eight-row loop replaced a dot and horizontal sum per (row of x, row of mins): 13-14 ms for
    a 512-token prefill's 6144x1024 Q4_K weight on a Zen 4, now ~4."""
    lib = cpu_kernels.load()
    assert lib is not None
    g = torch.Generator().manual_seed(n + k)
    groups, m = k // 32, 140
    mins = torch.rand(n, groups, generator=g) - 0.3
    x = torch.randn(m, k, generator=g)
    acc = torch.randn(m, n, generator=g)

    def run(rows: slice, dtype: torch.dtype, out: torch.dtype = torch.float32) -> torch.Tensor:
        xr, ar = x[rows].to(dtype).contiguous(), acc[rows].contiguous()
        y = torch.empty_like(ar, dtype=out)
        done = lib.qmins(
            xr.data_ptr(), int(dtype == torch.bfloat16), ar.data_ptr(), mins.data_ptr(),
            groups, None, 0, 0, y.data_ptr(), int(out == torch.bfloat16), xr.shape[0], n, k, 32,
        )  # fmt: skip
        assert done
        return y

    for dtype in (torch.float32, torch.bfloat16):
        sums = x.to(dtype).double().view(m, groups, 32).sum(-1)
        terms = sums.abs() @ mins.double().abs().T
        want = acc.double() - sums @ mins.double().T
        many = run(slice(0, m), dtype)
        assert bool(((many.double() - want).abs() <= 1e-5 * (terms + acc.double().abs())).all())
        rounded = run(slice(0, m), dtype, torch.bfloat16)
        assert torch.equal(rounded.view(torch.int16), many.to(torch.bfloat16).view(torch.int16))
        for rows in (slice(0, 1), slice(3, 5), slice(1, 9), slice(8, 9), slice(60, 130)):
            assert torch.equal(run(rows, dtype), many[rows]), (dtype, rows)
        for rows in (slice(0, 1), slice(63, 66), slice(139, 140)):
            assert torch.equal(run(rows, dtype, torch.bfloat16), rounded[rows]), (dtype, rows)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q2_K"])
def test_compact_mins_are_the_float32_mins_to_the_bit(kind: str) -> None:
    """The K-quants' mins as a GGUF file's layer holds them: each group's m (6 bits, Q2_K's 4)
    as a byte and each super-block's dmin in float32, 1 + 4 / per bytes a group where float32
    mins took 4 (a Q4_K weight: 0.70 bytes a weight, not 0.78). min = dmin * m is exact in
    float32, so every path gives the float32 form's bits: the kernels then the mins' term at a
    decode's and a prefill's rows, the panels that fold the mins in, embedding rows."""
    w = _k_weight(kind)
    compact, plain = _holder(w), _holder(w, compact=False)
    assert compact.mins is not None and compact.mins_scales is not None
    assert compact.mins.dtype == torch.uint8 and plain.mins_scales is None
    assert torch.equal(compact.view().float_mins(), plain.mins)
    n, groups, per = 96, w.scales.shape[1], w.mins_per
    assert plain.nbytes() - compact.nbytes() == n * groups * 3 - n * groups // per * 4
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    for rows in (1, 5, 70):
        for dtype in (torch.bfloat16, torch.float32):
            assert torch.equal(compact.matmul(x[:rows], dtype), plain.matmul(x[:rows], dtype))
    ids = torch.tensor([[3, 90], [0, 95]])
    assert torch.equal(compact.rows(ids, torch.float32), plain.rows(ids, torch.float32))
    folded = 0
    for pick in ("amx_panel", "amx_bf16_vpanel"):
        ws = [h.whole() for h in (compact, plain)]
        if pick == "amx_bf16_vpanel":
            ws = [cpu_vpanel.packed_copy(v) for v in ws]
        y = [cpu_panel.mins_folded(pick, x, v, torch.float32) for v in ws]
        assert (y[0] is None) == (y[1] is None)
        if y[0] is not None and y[1] is not None:
            assert torch.equal(y[0], y[1])
            folded += 1
    lib = cpu_kernels.load()
    assert folded or lib is None or not lib.qamx_mins  # a build with the folding kernels ran one


@pytest.mark.parametrize(
    "n, k, per", [(37, 1024, 8), (19, 2048, 16), (64, 512, 8), (9, 2056 * 32, 8)]
)
def test_compact_mins_term_has_the_float32_terms_bits_at_any_rows(n: int, k: int, per: int) -> None:
    """qmins.c with the mins compact (m bytes, a dmin per `per` groups): eight rows of mins at
    a time at one row of x, each block turned to fp32 once per run at more (on the stack; past
    2048 groups converted as they are read); every row of y the float32 form's bits, alone or
    in any batch (rows of mins past a multiple of 8: 37, 19, 9)."""
    lib = cpu_kernels.load()
    assert lib is not None
    g = torch.Generator().manual_seed(n)
    groups, m = k // 32, 140
    codes = torch.randint(0, 64, (n, groups), generator=g, dtype=torch.uint8)
    dmin = torch.rand(n, groups // per, generator=g) / 64
    mins = codes.float() * dmin.repeat_interleave(per, dim=1)
    x = torch.randn(m, k, generator=g).bfloat16()
    acc = torch.randn(m, n, generator=g)

    def run(rows: slice, compact: bool) -> torch.Tensor:
        xr, ar = x[rows].contiguous(), acc[rows].contiguous()
        y = torch.empty_like(ar, dtype=torch.bfloat16)
        form = (codes.data_ptr(), groups, dmin.data_ptr(), groups // per, per) if compact else (
            mins.data_ptr(), groups, None, 0, 0)  # fmt: skip
        assert lib.qmins(xr.data_ptr(), 1, ar.data_ptr(), *form, y.data_ptr(), 1, xr.shape[0],
                         n, k, 32)  # fmt: skip
        return y.view(torch.int16)

    want = run(slice(0, m), False)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 5), slice(1, 9), slice(0, m), slice(60, 130)):
        assert torch.equal(run(rows, True), want[rows]), rows


def test_embedding_rows_subtract_the_mins() -> None:
    h = _holder(_k_weight("Q4_K"))
    full = dequantize(h.view(), torch.float32)
    few, many = torch.tensor([[3, 0]]), torch.arange(40).view(2, 20)  # C rows / torch gather
    assert torch.equal(h.rows(few, torch.float32), full[few])
    assert torch.equal(h.rows(many, torch.float32), full[many])
    assert torch.equal(h.rows(few, torch.bfloat16), full[few].to(torch.bfloat16))


def test_vocabulary_padding_rows_are_zero() -> None:
    w = _k_weight("Q4_K", n=90)
    h = QuantWeight(
        96, 512, bits=4, fp8=False, group_size=32, groups=16, scattered_groups=False, mins=True
    )
    h.mins.fill_(float("nan"))  # type: ignore[union-attr]  # as uninitialised memory may read
    h.load_rows(w)
    assert torch.equal(h.rows(torch.tensor([95]), torch.float32), torch.zeros(1, 512))


@needs_vnni_panel
def test_vnni_panels_then_the_mins_term(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", "vnni_panel")
    h = _holder(_k_weight("Q4_K"))
    ref_w = dequantize(h.view(), torch.float32)
    (h.kernel,), _ = cpu_choice.kernels_for([[h.view()]], torch.float32, "off")
    h.pack_vnni()
    x = torch.randn(5, 512)
    ref = x @ ref_w.t()
    assert (h.matmul(x) - ref).norm() / ref.norm() < 3e-4  # the panels round x to 16 bits
    assert torch.equal(h.rows(torch.tensor([7]), torch.float32), ref_w[7:8])


@pytest.mark.parametrize(
    "kind, pick",
    [("Q4_K", "amx_panel"), ("Q4_K", "amx_bf16_vpanel"), ("Q5_K", "amx_bf16_vpanel"),
     ("Q2_K", "amx_bf16_vpanel")],
)  # fmt: skip
def test_a_prefills_rows_take_the_mins_into_the_bf16_panels(
    kind: str, pick: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From cpu_panel.FOLD_MINS_ROWS rows of bf16 x (a prefill's: more than the decode chain's
    steps), the picks that dequantize panels into bf16 take each group's min into the panel's
    values (qamx.c's *_mins): the product of x and the weight dequantized with its mins and
    rounded to bf16, a bf16 twin's weight, to fp32 sum order; before, qmins.c's term after the
    matmul left a product further from it (~6e-4 of its size) at up to a third of a Q4_1
    prefill's time. Fewer rows keep the kernel and that term, the decode chain's bits. Builds
    without those kernels (no AVX512-BF16) keep the term at every row count."""
    assert cpu_panel.FOLD_MINS_ROWS > cpu_chain.MAX_ROWS  # the chain's steps keep the term
    monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", pick)
    h = _holder(_k_weight(kind, n=96, k=512))
    (h.kernel,), _ = cpu_choice.kernels_for([[h.view()]], torch.bfloat16, "off")
    lib = cpu_kernels.load()
    assert lib is not None
    packed = pick == "amx_bf16_vpanel" and bool(lib.qvpanel)  # (AVX2: the defaults run)
    if kind == "Q2_K" and not packed:  # groups of 16: no kernel here, and no file holds them
        assert not cpu_vpanel.takes_groups_of_16()
        return
    twin = dequantize(h.whole(), torch.float32).bfloat16().float()
    if packed:
        h.pack_vnni()
    table = lib.qamx_mins_packed if packed else lib.qamx_mins
    w = h.whole()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(cpu_panel.FOLD_MINS_ROWS + 7, 512, generator=g).bfloat16()
    y = h.matmul(x, torch.float32)
    bare = without_mins(w)

    def term_after(rows: torch.Tensor) -> torch.Tensor:
        assert h.kernel is not None
        run = h.kernel
        return cpu_panel.minus_mins(lambda a, dt: through(run, a, bare, dt), rows, w, torch.float32)

    if cpu_gemv.kind(w) in table:
        size = x.float().abs() @ twin.abs().T
        assert bool(((y - x.float() @ twin.T).abs() <= 2e-5 * size).all())
    else:
        assert torch.equal(y, term_after(x))
    few = x[: cpu_panel.FOLD_MINS_ROWS - 1]
    assert torch.equal(h.matmul(few, torch.float32), term_after(few))


def test_the_chooser_times_a_weight_with_mins_as_its_layer_runs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A weight with group mins is timed as its layer runs it: each candidate's kernel and the
    mins' term after it, or, from FOLD_MINS_ROWS rows, for a candidate that folds the mins into
    its panels, that kernel alone. So a folding kernel a little slower than another (less than
    the term) wins the prefill rows and loses the others (before: the kernels were timed
    alone, and it lost every row count). Kernels, term and clock are stand-ins here: each
    call moves the clock by its cost."""
    now = [0.0]

    def costing(seconds: float) -> cpu_choice.Run:
        def run(x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
            now[0] += seconds
            return torch.zeros(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype)

        return run

    def folded(pick: str, x: torch.Tensor, w: QTensor, dtype: torch.dtype | None) -> Any:
        return costing(1.5)(x, w, dtype) if pick == "amx_panel" else None

    def term(run: Any, x: torch.Tensor, w: QTensor, dtype: torch.dtype | None) -> torch.Tensor:
        now[0] += 1.0
        return run(x, torch.float32)

    monkeypatch.setitem(cpu_choice._RUN, "qgemv", costing(1.0))
    monkeypatch.setitem(cpu_choice._RUN, "amx_panel", costing(1.5))
    monkeypatch.setattr(cpu_panel, "mins_folded", folded)
    monkeypatch.setattr(cpu_panel, "minus_mins", term)
    w = _holder(_k_weight("Q4_K")).view()
    assert w.mins is not None
    timings = cpu_choice.measure(
        [w], torch.bfloat16, clock=lambda: now[0], names=("qgemv", "amx_panel")
    )
    for b, rows in enumerate(TIMED_ROWS):
        want = (2.0, 1.5) if rows >= cpu_panel.FOLD_MINS_ROWS else (2.0, 2.5)
        assert (timings["qgemv"][b], timings["amx_panel"][b]) == want, rows
    # the tuning cache keeps them apart from the same codes without mins
    assert cpu_choice.shape_key(w, torch.bfloat16) != cpu_choice.shape_key(
        without_mins(w), torch.bfloat16
    )


@pytest.mark.parametrize("experts", [0, 3])
def test_the_int4_gpu_path_folds_the_mins_into_its_zeros(experts: int) -> None:
    """torch's int4 matmul computes (q - 8) * scale + zero: zero = (8 - z) * scale - min, and
    no mins' term after it (its twin on the CPU)."""
    h = _holder(_k_weight("Q4_K"), experts)
    ref = dequantize(h.view(0) if experts else h.view(), torch.float32)
    line = cm.prepare(nn.ModuleDict({"w": h}), torch.bfloat16, (9, 0), ops=cm.CPU_INT4)
    assert line == "quantized weights on the GPU: 1 int4 weight-only matmul"
    assert h.mins is None
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    # (qlinear runs the kernel set up on a GPU where x is on one; its CPU twin directly here)
    y = h.kernel(x, h[0] if experts else h.view())  # type: ignore[misc]
    want = x.float() @ ref.t()
    assert (y.float() - want).norm() / want.norm() < 0.02


def test_the_dequantizing_gpu_path_includes_the_mins() -> None:
    h = _holder(_k_weight("Q5_K"))  # 8-bit codes: dequantized for the GPU
    ref = dequantize(h.view(), torch.bfloat16)
    cm.prepare(nn.ModuleDict({"w": h}), torch.bfloat16, (9, 0), ops=cm.CPU_INT4)
    assert h.mins is None and torch.equal(h.codes, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_experts_with_mins_in_one_c_call_give_the_per_expert_loops_bits(
    tokens: int, dtype: torch.dtype
) -> None:
    """A mixture's decode: the experts in one C call (csrc/moe.c, each expert's kernel into
    float32 then qmins.c's term) against the per-expert loop (QuantWeight.expert_matmul):
    the same bits; and the dequantized experts' result."""
    from minisgl.layers import moe

    experts, hidden, inter = 4, 256, 256
    w13 = _holder(_k_weight("Q4_K", n=2 * inter, k=hidden, seed=1), experts)
    w2 = _holder(_k_weight("Q5_K", n=hidden, k=inter, seed=2), experts)
    for e in range(experts):  # each expert its own weights: scaled codes' scales and mins
        for h in (w13, w2):
            h.scales[e] *= e + 1
            h.mins_scales[e] *= e + 1  # type: ignore[index]  # the compact mins' dmin
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g).to(dtype)
    mm13, mm2 = w13.expert_matmul, w2.expert_matmul
    assert moe.decode_call(x, w13, w2, mm13, mm2) is not None
    one = moe.fused_moe(x, w13, w2, weights, ids, mm13, mm2)
    loop = moe.fused_moe(x, w13, w2, weights, ids, mm13, mm2, one_call_tokens=0)
    assert torch.equal(one, loop)
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(2):
            e = int(ids[t, j])
            gate_up = x[t].float() @ dequantize(w13.view(e), torch.float32).t()
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            want[t] += float(weights[t, j]) * (h @ dequantize(w2.view(e), torch.float32).t())
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    assert (one.float() - want).norm() / want.norm() < tol


def test_without_memory_for_the_sums_of_x_nothing_is_computed_and_it_says_so() -> None:
    """qmins.c returns 0 where it cannot allocate x's group sums (the decode chain then raises,
    as for a matmul that computed nothing; cpu_panel.minus_mins raises MemoryError): 2^40 rows'
    sums (4 TiB) are refused before any row is read."""
    from minisgl.layers import cpu_kernels

    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip("no CPU kernels here")
    assert lib.qmins(0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1 << 40, 1, 32, 32) == 0
    x, acc, mins = torch.ones(1, 32), torch.full((1, 1), 5.0), torch.full((1, 1), 0.5)
    y = torch.empty(1, 1)
    assert lib.qmins(x.data_ptr(), 0, acc.data_ptr(), mins.data_ptr(), 1, 0, 0, 0, y.data_ptr(),
                     0, 1, 1, 32, 32) == 1  # fmt: skip
    assert y.item() == 5.0 - 0.5 * 32
