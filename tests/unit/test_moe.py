"""Mixture of experts: routing and the fused forward against plain per-token references."""

from __future__ import annotations

import math

import pytest
import torch

from minisgl.layers import cpu_kernels, kernel_choice, moe
from minisgl.layers.moe import FusedMoE, SparseMoeBlock, fused_moe, route
from minisgl.models.config import ModelConfig
from minisgl.quant import cpu_gemv
from minisgl.quant import weight as quant_weight
from minisgl.quant.qtensor import FP8
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme
from minisgl.quant.weight import QuantWeight


def ref_route(logits: list[float], k: int, renormalize: bool) -> list[tuple[int, float]]:
    """Softmax, the k most probable experts (ties to the lower id), optionally renormalised."""
    m = max(logits)
    exps = [math.exp(v - m) for v in logits]
    probs = [e / sum(exps) for e in exps]
    chosen = sorted(range(len(probs)), key=lambda e: (-probs[e], e))[:k]
    total = sum(probs[e] for e in chosen) if renormalize else 1.0
    return [(e, probs[e] / total) for e in chosen]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_route_matches_reference(k: int, renormalize: bool) -> None:
    logits = torch.randn(13, 16, generator=torch.Generator().manual_seed(k)) * 3
    weights, ids = route(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.shape == (13, k)
    for t in range(13):
        want = ref_route(logits[t].tolist(), k, renormalize)
        assert ids[t].tolist() == [e for e, _ in want]
        assert weights[t].tolist() == pytest.approx([w for _, w in want], rel=1e-5)
    if renormalize:
        assert torch.allclose(weights.sum(-1), torch.ones(13))


def test_route_ties_go_to_the_lower_expert_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 1.0], [5.0] * 6])
    weights, ids = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 3], [0, 1]]
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    for t in range(2):
        assert [e for e, _ in ref_route(logits[t].tolist(), 2, True)] == ids[t].tolist()


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_s_c_route_chooses_as_torch_does(dtype: torch.dtype) -> None:
    """At decode (<= 16 tokens) the CPU routes by one C call (the decode chain's route too): the
    experts and order of torch's stable sort, the same weights to fp32 rounding, in the dtype
    asked for; a row of NaN logits still picks k distinct experts (torch's first k)."""
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(40, 128, generator=g) * 2).to(dtype)
    logits[3, 5] = logits[3, 9] = logits[3].max()  # a tie at the top
    logits[11] = float("nan")
    for renormalize in (True, False):
        many_w, many_ids = route(logits, 8, renormalize)  # > 16 tokens: torch's ops
        for t0 in range(0, 40, 16):
            w, ids = route(logits[t0 : t0 + 16], 8, renormalize, dtype)
            assert w.dtype == dtype and ids.dtype == torch.int64
            assert torch.equal(ids, many_ids[t0 : t0 + 16])
            # an fp32 rounding apart may round to neighbouring bf16 values
            tol = 1e-6 if dtype == torch.float32 else 8e-3
            want = many_w[t0 : t0 + 16].to(dtype)
            torch.testing.assert_close(w, want, equal_nan=True, atol=tol, rtol=tol)
    assert route(logits[11:12], 8, True)[1].tolist() == [list(range(8))]


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2.T


def ref_moe(x, w13, w2, weights, ids) -> torch.Tensor:  # noqa: ANN001
    """One token and one chosen expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += weights[t, j] * _swiglu(x[t : t + 1], w13[e], w2[e])[0]
    return out


@pytest.mark.parametrize("tokens", [1, 2, 9, 40])
def test_fused_moe_matches_per_token_reference(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    e, h, i, k = 16, 64, 32, 4
    x = torch.randn(tokens, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) / 8, torch.randn(e, h, i, generator=g) / 8
    weights, ids = route(torch.randn(tokens, e, generator=g), k, True)
    got = fused_moe(x, w13, w2, weights, ids)
    assert torch.allclose(got, ref_moe(x, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_fused_moe_reads_only_the_chosen_experts() -> None:
    """Experts no token routes to are never touched: NaN weights there change nothing."""
    g = torch.Generator().manual_seed(0)
    e, h, i = 16, 64, 32
    x = torch.randn(5, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) / 8, torch.randn(e, h, i, generator=g) / 8
    ids = torch.tensor([[0, 3], [3, 7], [7, 0], [0, 3], [12, 3]])
    weights = torch.full((5, 2), 0.5)
    unused = [n for n in range(e) if n not in ids.unique().tolist()]
    w13[unused], w2[unused] = float("nan"), float("nan")
    got = fused_moe(x, w13, w2, weights, ids)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, ref_moe(x, w13, w2, weights, ids), atol=1e-4)


def test_fused_moe_bf16_close_to_fp32() -> None:
    g = torch.Generator().manual_seed(1)
    e, h, i = 8, 128, 64
    x = torch.randn(6, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) / 8, torch.randn(e, h, i, generator=g) / 8
    weights, ids = route(torch.randn(6, e, generator=g), 2, True)
    want = ref_moe(x, w13, w2, weights, ids)
    got = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights.bfloat16(), ids)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, atol=0.1, rtol=0.05)


def test_tensor_parallel_shards_sum_to_the_whole_block() -> None:
    """Each rank loads its slice of every expert from the HF tensors; the partial outputs add
    up to the unsharded block's output (the all-reduce's job)."""
    g = torch.Generator().manual_seed(2)
    e, h, i, k = 4, 32, 16, 2
    hf = {"gate.weight": torch.randn(e, h, generator=g)}
    for n in range(e):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            hf[f"experts.{n}.{proj}.weight"] = torch.randn(*shape, generator=g) / 4

    def build(rank: int, size: int) -> SparseMoeBlock:
        block = SparseMoeBlock(e, k, h, i, True, rank, size)
        assert block.weight_names() == set(hf)
        assert all(block.load(name, t) for name, t in hf.items())
        assert not block.load("experts.9.up_proj.weight", hf["experts.0.up_proj.weight"])
        return block

    x = torch.randn(7, h, generator=g)
    whole = build(0, 1)
    shards = [build(r, 2) for r in range(2)]
    assert shards[0].experts.w13.shape == (e, i, h) and shards[0].experts.w2.shape == (e, h, i // 2)
    weights, ids = route(x @ hf["gate.weight"].T, k, True)
    partial = sum(fused_moe(x, s.experts.w13, s.experts.w2, weights, ids) for s in shards)
    assert torch.allclose(partial, whole(x), atol=1e-4)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        FusedMoE(e, h, 15, 0, 2)


def test_sparse_layers_follow_step_and_mlp_only_layers() -> None:
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    config = ModelConfig.from_dict(raw)
    assert [config.is_moe_layer(n) for n in range(6)] == [False, True, False, False, False, True]
    assert config.architecture == "Qwen3MoeForCausalLM"
    dense = ModelConfig.from_dict({**raw, "num_experts": 0})
    assert not any(dense.is_moe_layer(n) for n in range(6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_grouped_gemm_path_matches_the_per_expert_loop(tokens: int, dtype: torch.dtype) -> None:
    """The GPU path (two grouped GEMMs, no host sync) computes what the per-expert loop does;
    torch runs the same operator on the CPU, so it is checked here."""
    from minisgl.layers.moe import grouped_moe

    g = torch.Generator().manual_seed(tokens)
    e, h, i, k = 16, 64, 32, 4
    x = torch.randn(tokens, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / 8).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / 8).to(dtype)
    weights, ids = route(torch.randn(tokens, e, generator=g), k, True)
    want = ref_moe(x.float(), w13.float(), w2.float(), weights, ids)
    got = grouped_moe(x, w13, w2, weights.to(dtype), ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_cpu_layers_keep_the_measured_kernels_not_the_grouped_path() -> None:
    from minisgl.layers.moe import FusedMoE

    moe = FusedMoE(num_experts=4, hidden_size=16, intermediate_size=8)
    moe.w13.data.normal_()
    moe.w2.data.normal_()
    x = torch.randn(3, 16)
    weights, ids = route(torch.randn(3, 4), 2, True)
    moe(x, weights, ids)
    assert moe.grouped is False


@pytest.mark.parametrize("tokens", [3, 40])
def test_grouping_by_expert_reads_nothing_back(tokens: int) -> None:
    """On a GPU each read of the routing waits for the device: the grouped path reads none,
    the per-expert loop one per layer (where it sat, torch.bincount synced twice more)."""
    from minisgl.layers.moe import grouped_moe
    from minisgl.testing.host_reads import HostReads

    g = torch.Generator().manual_seed(tokens)
    e, h, i, k = 16, 64, 32, 4
    x = torch.randn(tokens, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) / 8, torch.randn(e, h, i, generator=g) / 8
    weights, ids = route(torch.randn(tokens, e, generator=g), k, True)
    with HostReads() as grouped:
        grouped_moe(x, w13, w2, weights, ids)
    assert grouped.count == 0 and not grouped.syncing_ops, (grouped.calls, grouped.syncing_ops)
    with HostReads() as loop:
        fused_moe(x, w13, w2, weights, ids)
    assert dict(loop.calls) == {"tolist": 1} and not loop.syncing_ops, loop.syncing_ops


needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")


def _bf16_experts(seed: int, e: int = 16, h: int = 64, i: int = 32):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / 8).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) / 8).bfloat16()
    return g, w13, w2


@needs_kernels
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 16])
def test_decode_s_one_call_gives_the_per_expert_loop_s_bits(
    tokens: int, weights_dtype: torch.dtype, x_dtype: torch.dtype
) -> None:
    """bf16 experts at decode run as one C call (cpu_kernels.moe_decode): each expert's rows are
    the GEMV's, the SiLU silu_mul's, the weighting the loop's fp32 sum in slot order, so the
    layer's output is the loop's, bit for bit (an expert picked by several tokens included)."""
    g, w13, w2 = _bf16_experts(tokens)
    x = torch.randn(tokens, 64, generator=g).to(x_dtype)
    weights, ids = route(torch.randn(tokens, 16, generator=g), 8, True)
    weights = weights.to(weights_dtype)
    loop = fused_moe(x, w13, w2, weights, ids, one_call_tokens=0)
    one_call = fused_moe(x, w13, w2, weights, ids)
    assert one_call.dtype == x_dtype
    assert torch.equal(one_call, loop)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 8])
def test_decode_runs_the_experts_in_one_call_not_a_gemv_per_expert(
    tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    g, w13, w2 = _bf16_experts(tokens)
    x = torch.randn(tokens, 64, generator=g).bfloat16()
    weights, ids = route(torch.randn(tokens, 16, generator=g), 4, True)
    gemv_calls: list[int] = []
    gemv = cpu_kernels.gemv
    monkeypatch.setattr(cpu_kernels, "gemv", lambda *a: gemv_calls.append(1) or gemv(*a))
    fused_moe(x, w13, w2, weights, ids)
    assert gemv_calls == []
    experts = len(ids.unique())
    fused_moe(x, w13, w2, weights, ids, one_call_tokens=0)
    assert len(gemv_calls) == 2 * experts


@needs_kernels
def test_one_call_reads_only_the_chosen_experts_and_refuses_unknown_ones() -> None:
    g, w13, w2 = _bf16_experts(3)
    x = torch.randn(2, 64, generator=g).bfloat16()
    ids = torch.tensor([[0, 3], [3, 15]])
    weights = torch.full((2, 2), 0.5)
    unused = [n for n in range(16) if n not in (0, 3, 15)]
    w13[unused], w2[unused] = float("nan"), float("nan")
    got = fused_moe(x, w13, w2, weights, ids)
    assert torch.isfinite(got).all()
    assert torch.equal(got, fused_moe(x, w13, w2, weights, ids, one_call_tokens=0))
    with pytest.raises(IndexError, match="expert id 16"):
        cpu_kernels.moe_decode(x, w13, w2, weights, torch.tensor([[0, 3], [16, 1]]))


@needs_kernels
def test_one_call_only_where_every_row_count_up_to_the_batch_runs_the_gemv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The measured picks decide: where the experts' matmul is another kernel than the GEMV
    for some row count up to T (here the GEMM from 5 rows), T tokens run the per-expert loop,
    whose kernels those are."""
    from minisgl.layers import cpu_linear, kernel_choice

    names = kernel_choice.row_table(
        ("gemv", "gemv", "gemm", "gemm", "gemm", "gemm", "gemm", "gemm")
    )
    assert names[4] == "gemv" and names[5] == "gemm"

    def row_runner(weights, tuning):  # noqa: ANN001, ANN202
        return (
            (lambda x, w: cpu_kernels.gemv(x, w) if x.shape[0] <= 4 else cpu_kernels.gemm(x, w)),
            "",
            names,
        )

    monkeypatch.setattr(cpu_linear, "row_runner", row_runner)
    moe = FusedMoE(num_experts=16, hidden_size=64, intermediate_size=32)
    _, w13, w2 = _bf16_experts(4)
    moe.w13.data, moe.w2.data = w13, w2
    moe.prepare_cpu_kernels("full")
    assert moe.one_call_tokens == 4
    calls: list[int] = []
    moe_decode = cpu_kernels.moe_decode
    monkeypatch.setattr(cpu_kernels, "moe_decode", lambda *a: calls.append(1) or moe_decode(*a))
    g = torch.Generator().manual_seed(5)
    for tokens, one_call in ((4, True), (5, False)):
        calls.clear()
        x = torch.randn(tokens, 64, generator=g).bfloat16()
        weights, ids = route(torch.randn(tokens, 16, generator=g), 4, True)
        moe(x, weights.bfloat16(), ids)
        assert bool(calls) == one_call


@pytest.mark.skipif(
    cpu_kernels.load() is None or cpu_kernels.load().gemv512_bf16 is None,
    reason="no AVX-512 build here: gemv512 is never picked",
)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_experts_on_gemv512_run_in_one_call(
    x_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float experts whose measured picks are gemv512 (AVX-512), or gemv for one row and
    gemv512 from two: one C call through those kernels per expert (moe_decode_f), the loop's
    bits, where before they ran one by one from Python."""
    from minisgl.layers import cpu_linear

    w13_names = kernel_choice.row_table(("gemv512",) * len(kernel_choice.BUCKETS))
    w2_names = kernel_choice.row_table(("gemv",) + ("gemv512",) * (len(kernel_choice.BUCKETS) - 1))
    assert w2_names[1] == "gemv" and w2_names[2] == "gemv512"
    tables = iter([w13_names, w2_names])

    def row_runner(weights, tuning):  # noqa: ANN001, ANN202
        names = next(tables)
        run = cpu_linear._RUN
        return (lambda x, w: run[names[x.shape[0]]](x, w, None, None)), "", names

    monkeypatch.setattr(cpu_linear, "row_runner", row_runner)
    moe_layer = FusedMoE(num_experts=16, hidden_size=64, intermediate_size=32)
    _, w13, w2 = _bf16_experts(6)
    moe_layer.w13.data, moe_layer.w2.data = w13.to(x_dtype), w2.to(x_dtype)
    moe_layer.prepare_cpu_kernels("full")
    assert moe_layer.one_call_tokens == 0  # gemv_bf16's blocks run none of them
    calls: list[int] = []
    moe_decode_f = cpu_kernels.moe_decode_f
    monkeypatch.setattr(cpu_kernels, "moe_decode_f", lambda *a: calls.append(1) or moe_decode_f(*a))
    g = torch.Generator().manual_seed(9)
    for tokens in (1, 2, 5, 16):
        calls.clear()
        x = torch.randn(tokens, 64, generator=g).to(x_dtype)
        weights, ids = route(torch.randn(tokens, 16, generator=g), 4, True, x_dtype)
        one = moe_layer(x, weights, ids)
        loop = fused_moe(x, moe_layer.w13, moe_layer.w2, weights, ids, moe_layer.mm13,
                         moe_layer.mm2, 0)  # fmt: skip
        assert calls == [1]
        assert torch.equal(one, loop)


@needs_kernels
def test_routers_are_measured_once_over_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sparse layer's router gets the matmul picked for its shape, timed once over all
    of them (cold, as a step reads them); tuning off keeps the untuned GEMV."""
    from minisgl.layers import cpu_linear

    blocks = [SparseMoeBlock(16, 4, 64, 32, True) for _ in range(3)]
    for b in blocks:
        b.gate.data.normal_()
    assert moe.prepare_routers(blocks, "off") == []
    assert all(b.route_names is None and b.route_pick(1) == "gemv" for b in blocks)
    seen: list[int] = []
    names = kernel_choice.row_table(("gemv512",) * len(kernel_choice.BUCKETS))

    def row_runner(weights, tuning):  # noqa: ANN001, ANN202
        seen.append(len(weights))
        return (lambda x, w: x @ w.T), "routers line", names

    monkeypatch.setattr(cpu_linear, "row_runner", row_runner)
    assert moe.prepare_routers(blocks, "full") == ["routers line"]
    assert seen == [3]
    assert all(b.route_pick(8) == "gemv512" for b in blocks)
    x = torch.randn(2, 64)
    calls: list[int] = []
    blocks[0].route_mm = lambda x, w: calls.append(1) or x @ w.T
    blocks[0](x)
    assert calls == [1]


def _quantized_experts(method: str, e: int, n: int, k: int, g: torch.Generator) -> QuantWeight:
    scheme = load_scheme(method)
    qs = [quantize(torch.randn(n, k, generator=g) / 8, scheme) for _ in range(e)]
    w = QuantWeight(
        n,
        k,
        bits=qs[0].bits,
        fp8=qs[0].codes.dtype == FP8,
        group_size=qs[0].group_size,
        groups=qs[0].scales.shape[1],
        scattered_groups=False,
        experts=e,
    )
    for i, q in enumerate(qs):
        w[i].copy_(q)
    return w


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_quantized_experts_in_one_call_give_the_per_expert_loop_s_bits(
    tokens: int, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quantized experts at decode: one C call runs each chosen expert's rows through the
    quantized GEMV as the loop calls it, so the same bits, and no per-expert Python call."""
    g = torch.Generator().manual_seed(tokens)
    e, h, i = 16, 256, 128
    w13, w2 = _quantized_experts(method, e, 2 * i, h, g), _quantized_experts(method, e, h, i, g)
    x = torch.randn(tokens, h, generator=g).bfloat16()
    weights, ids = route(torch.randn(tokens, e, generator=g), 8, True)
    weights = weights.bfloat16()
    loop = fused_moe(x, w13, w2, weights, ids, w13.expert_matmul, w2.expert_matmul, 0)
    calls: list[int] = []
    qgemv = cpu_gemv.qgemv
    monkeypatch.setattr(cpu_gemv, "qgemv", lambda *a: calls.append(1) or qgemv(*a))
    one_call = fused_moe(x, w13, w2, weights, ids, w13.expert_matmul, w2.expert_matmul)
    assert calls == []
    assert torch.equal(one_call, loop)


@pytest.mark.skipif(
    cpu_kernels.load() is None or not cpu_kernels.load().qvpanel,
    reason="no AVX512-VNNI build here: experts are never packed",
)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_experts_packed_into_panels_run_in_one_call_up_to_16_tokens(
    method: str, x_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experts repacked in place into VNNI panels (QuantWeight.pack_vnni, in runs): the
    panels' kernel serves every row count, so up to 16 tokens (where qgemv's picks stopped at
    4-8) the experts are one C call giving the loop's bits; and the products are those of the
    row-major codes (to the summation's rounding)."""
    from minisgl.quant.cpu_choice import PACKED, QuantKernel
    from minisgl.quant.matmul import qlinear

    g = torch.Generator().manual_seed(11)
    e, h, i = 8, 256, 128
    w13, w2 = _quantized_experts(method, e, 2 * i, h, g), _quantized_experts(method, e, h, i, g)
    x = torch.randn(16, h, generator=g).to(x_dtype)
    weights, ids = route(torch.randn(16, e, generator=g), 4, True, x_dtype)
    rows = w13[3].codes.clone(), w2[5].codes.clone()
    want = [qlinear(x, w13[e], None) for e in (3, 7)] + [qlinear(x[:, :i], w2[5], None)]
    unpacked = fused_moe(x, w13, w2, weights, ids, w13.expert_matmul, w2.expert_matmul, 0)
    # w13 repacked 3 experts at a time (8 = 3 + 3 + 2), w2 all 8 at once
    runs = {id(w13): w13.nbytes() // 8 * 3, id(w2): quant_weight.PACK_BYTES}
    for w in (w13, w2):
        w.kernel = QuantKernel((PACKED,) * len(kernel_choice.BUCKETS))
        monkeypatch.setattr(quant_weight, "PACK_BYTES", runs[id(w)])
        w.pack_vnni()
    assert not torch.equal(w13[3].codes, rows[0]) and w13[3].codes.shape == rows[0].shape
    got = [w13.expert_matmul(x, w13[e]) for e in (3, 7)] + [w2.expert_matmul(x[:, :i], w2[5])]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    for tokens in (1, 8, 16):
        call = moe.decode_call(x[:tokens], w13, w2, w13.expert_matmul, w2.expert_matmul)
        assert call is not None and call[0] == "q"
        args = (x[:tokens], w13, w2, weights[:tokens], ids[:tokens])
        one = fused_moe(*args, w13.expert_matmul, w2.expert_matmul)
        loop = fused_moe(*args, w13.expert_matmul, w2.expert_matmul, 0)
        assert torch.equal(one, loop)
    torch.testing.assert_close(
        fused_moe(x, w13, w2, weights, ids, w13.expert_matmul, w2.expert_matmul).float(),
        unpacked.float(),
        atol=5e-2,
        rtol=5e-2,
    )


def test_quantized_experts_picks_are_read_once_not_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether a decode step's experts run as one call is read from their kernel's picks; the
    row table that answer comes from (514 entries, ~0.2 ms to build in Python) was built twice
    per mixture layer and step: ~19 ms of a 48-layer Qwen3-30B-A3B step. Now once per picks."""
    from minisgl.quant.cpu_choice import QuantKernel

    g = torch.Generator().manual_seed(3)
    e, h, i = 16, 256, 128
    w13, w2 = _quantized_experts("int4", e, 2 * i, h, g), _quantized_experts("int4", e, h, i, g)
    picks = ("qgemv",) * 3 + ("amx_panel",) * (len(kernel_choice.BUCKETS) - 3)
    w13.kernel, w2.kernel = QuantKernel(picks), QuantKernel(picks)
    built: list[int] = []
    row_table = kernel_choice.row_table
    monkeypatch.setattr(kernel_choice, "row_table", lambda p: built.append(1) or row_table(p))
    for _ in range(5):
        x = torch.randn(1, h, generator=g).bfloat16()
        weights, ids = route(torch.randn(1, e, generator=g), 8, True)
        fused_moe(x, w13, w2, weights.bfloat16(), ids, w13.expert_matmul, w2.expert_matmul)
    assert len(built) <= 1


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_run_in_one_call_on_any_single_call_pick(method: str) -> None:
    """The one call runs each expert's rows through the kernel its picks name for that row
    count, wherever that pick is one C call (the panels, the AMX kernels), not only where it is
    the quantized GEMV: on an AMX Xeon the untuned picks are amx_int from 2 rows, and every
    decode batch of 2+ tokens ran its experts one by one from Python. A pick that is no single
    call (chunks dequantized from Python) ends the one call's rows there."""
    from minisgl.quant.cpu_choice import QuantKernel

    g = torch.Generator().manual_seed(5)
    e, h, i = 8, 256, 128
    w13, w2 = _quantized_experts(method, e, 2 * i, h, g), _quantized_experts(method, e, h, i, g)
    # qgemv at 1 row, the panels at 2-4, dequantized chunks (no single call) from 5
    picks = ("qgemv", "amx_panel") + ("dequant_gemm",) * (len(kernel_choice.BUCKETS) - 2)
    w13.kernel, w2.kernel = QuantKernel(picks), QuantKernel(picks)
    x = torch.randn(8, h, generator=g).bfloat16()
    weights, ids = route(torch.randn(8, e, generator=g), 4, True)
    weights = weights.bfloat16()
    for tokens in (1, 2, 4, 5, 8):
        call = moe.decode_call(x[:tokens], w13, w2, w13.expert_matmul, w2.expert_matmul)
        assert (call is not None) == (tokens <= 4), tokens
        args = (x[:tokens], w13, w2, weights[:tokens], ids[:tokens])
        one = fused_moe(*args, w13.expert_matmul, w2.expert_matmul)
        loop = fused_moe(*args, w13.expert_matmul, w2.expert_matmul, 0)
        assert torch.equal(one, loop), tokens
