"""The CPU decode chain (layers/cpu_chain.py: a decode step's layers as one C call) against the
same model run layer by layer: the same kernels on the same arguments, so the same bits, for
float and quantized weights, one and several requests, short prefills alone and beside a decode
(steps of few rows: the chain's) and a long one (which runs layer by layer)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch
from test_model import Runner, load, prompts, write_hf_model

from minisgl.kvcache.kv_pool import FP8
from minisgl.layers import cpu_chain, cpu_kernels
from minisgl.layers.kernel_choice import BUCKETS
from minisgl.models.config import ModelConfig
from minisgl.quant import cpu_choice
from minisgl.quant.matmul import qlinear
from minisgl.quant.weight import QuantWeight

# Widths the quantized kernels take (groups of 128 input features).
SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32)
# Request 0's 3-token prompt (the chain at three rows), request 1's first 70 prompt tokens
# beside request 0's first decode (a prompt chunk too long to attend row by row: layer by
# layer), its last 3 beside the next decode (four rows), then both decode (two rows), then
# request 1 alone.
SCHEDULE = [[3, 0], [1, 70], [1, 3], [1, 1], [0, 1], [0, 1]]


def _run(
    path: Path,
    dtype: torch.dtype,
    quantization: str | None,
    cache_dtype: torch.dtype | None = None,
    **kw: str,
) -> tuple[list, dict]:
    got, chains, _ = _run_model(path, dtype, quantization, cache_dtype, **kw)
    return got, chains


def _run_model(
    path: Path,
    dtype: torch.dtype,
    quantization: str | None,
    cache_dtype: torch.dtype | None = None,
    **kw: str,
) -> tuple[list, dict, Any]:
    model = load(path, dtype, quantization=quantization, cpu_kernel_tuning="off", **kw)
    runner = Runner(model, ModelConfig.from_dir(path), dtype, cache_dtype=cache_dtype)
    got = runner.run(prompts([6, 76]), SCHEDULE)
    return got, model.__dict__.get("_cpu_chains", {}), model


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("matmul", ["default", "gemv", "gemv512", "panel"])
@pytest.mark.parametrize("quantization", [None, "int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chain_equals_layer_by_layer(
    tmp_path: Path,
    dtype: torch.dtype,
    quantization: str | None,
    matmul: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if matmul != "default":
        monkeypatch.setenv("MINISGL_CPU_LINEAR", matmul)
    write_hf_model(tmp_path, **SHAPE)
    chained, chains, model = _run_model(tmp_path, dtype, quantization)
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    plain, none = _run(tmp_path, dtype, quantization)
    assert not any(none.values())
    # One to four rows, each built once; where the picks are the chain's own (the untuned
    # policy: the GEMV or qgemv at few rows), it ran.
    assert sorted(rows for rows, *_ in chains) == [1, 2, 3, 4]
    if matmul == "default" or quantization is not None:
        assert all(c is not None for c in chains.values())
    if matmul == "default" or quantization is not None:
        # The final norm and the LM head are the chain's last ops too (each step's logits a
        # new tensor: the steps' logits above are compared after the run), a quantized
        # model's head (int8 per channel by default) by its quantized kernel into float32.
        vocab = ModelConfig.from_dir(tmp_path).vocab_size
        assert {c[3] for c in chains.values()} == {vocab}
    # A quantized (tied) table's lookup is the chain's first op, and so is a bf16 one kept only
    # as its LM head's panels; a float table of its own stays F.embedding.
    in_chain = quantization is not None or model.model.embed_tokens.panels is not None
    assert all(c is None or (c[0].embedded is not None) == in_chain for c in chains.values())
    if dtype == torch.bfloat16 and matmul == "panel" and quantization is None:
        assert model.model.embed_tokens.panels is not None  # the case above is met
    for a, b in zip(chained, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_fp8_cache_runs_in_the_chain(
    tmp_path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kv-cache-dtype fp8: the chain's attention stores the step's rows rounded to e4m3 and
    reads the cache as e4m3, the same bits as the layers run one by one (whose prefills round
    their own rows in torch); and the cache changes the results (the fixture's keys and values
    are not all e4m3 values already)."""
    write_hf_model(tmp_path, **SHAPE)
    chained, chains, _ = _run_model(tmp_path, dtype, None, FP8)
    assert sorted(rows for rows, *_ in chains) == [1, 2, 3, 4]
    assert all(c is not None for c in chains.values())
    float_cache, _, _ = _run_model(tmp_path, dtype, None)
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    plain, none = _run(tmp_path, dtype, None, cache_dtype=FP8)
    assert not any(none.values())
    for a, b in zip(chained, plain, strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(chained, float_cache, strict=True))


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("pairs", [False, True], ids=["panel.c", "panel512.c"])
def test_the_chain_copies_token_rows_out_of_panels_as_torch_indexes_them(pairs: bool) -> None:
    """The lookup op for a bf16 table kept only as its LM head's panels, alone in a chain, in
    either build's panel layout: the rows cpu_kernels.panel_rows gives, bit for bit."""
    lib = cpu_kernels.load()
    assert lib is not None
    n, k = 96, 64
    width = 32 if pairs else 16
    torch.manual_seed(0)
    data = torch.randn(n // width, k, width).to(torch.bfloat16)  # any bits: a layout's copy
    panels = cpu_kernels.PanelWeight(data, n, pairs)
    ids = torch.tensor([0, 95, 17, 40, 63, 64], dtype=torch.int64)
    out = torch.empty(len(ids), k, dtype=torch.bfloat16)
    op = [cpu_chain.OP_PROWS, 0, data.data_ptr(), k, width, int(pairs), out.data_ptr(), len(ids)]
    ops = torch.tensor(op + [0] * (cpu_chain.OP_WORDS - len(op)), dtype=torch.int64)
    step = (ctypes.c_int64 * cpu_chain.STEP_WORDS)()
    step[cpu_chain.STEP_IDS] = ids.data_ptr()
    assert lib.decode_chain(ops.data_ptr(), 1, step) == 0
    assert torch.equal(out, cpu_kernels.panel_rows(panels, ids))


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize(
    ("quantization", "matmul"),
    [(None, "default"), (None, "gemv512"), ("int8", "default"), ("int4", "default"),
     ("fp8", "default")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_mixture_s_layers_run_in_the_chain(
    tmp_path: Path,
    dtype: torch.dtype,
    quantization: str | None,
    matmul: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Qwen3-MoE's sparse layers (router, top-k, the experts' one call) and its dense one are
    the chain's ops: the same logits as layer by layer, and no layer-by-layer decode step (a
    48-layer Qwen3-30B-A3B spent ~0.25 ms of Python a layer and step there)."""
    from minisgl.layers import moe

    if matmul != "default":  # every float matmul, the experts' too (AVX-512 builds)
        if cpu_kernels.load().gemv512_bf16 is None:
            pytest.skip("no AVX-512 build here: gemv512 is never picked")
        monkeypatch.setenv("MINISGL_CPU_LINEAR", matmul)
    write_hf_model(tmp_path, moe=True, moe_intermediate_size=128, **SHAPE)
    calls: list[int] = []
    forward = moe.SparseMoeBlock.forward
    monkeypatch.setattr(
        moe.SparseMoeBlock, "forward", lambda self, x: calls.append(x.shape[0]) or forward(self, x)
    )
    chained, chains = _run(tmp_path, dtype, quantization)
    assert sorted(rows for rows, *_ in chains) == [1, 2, 3, 4]
    # fp32 experts on the untuned GEMV run one by one at decode (gemv's one call takes bf16
    # ones): that stays layer by layer; on gemv512 (its own one call) they are chain ops.
    in_chain = not (dtype == torch.float32 and quantization is None and matmul == "default")
    assert all((c is not None) == in_chain for c in chains.values())
    # Two sparse layers a forward: the long prefill's step only where the chain ran.
    forwards = [1 + 70] if in_chain else [3, 1 + 70, 1 + 3, 2, 1, 1]
    assert calls == [rows for rows in forwards for _ in range(2)]
    if in_chain:
        chain = next(iter(chains.values()))[0]
        kind = "q" if quantization else "f" if matmul == "gemv512" else "bf16"
        # the router (16 experts x 128) through its pick, as the layer-by-layer forward does
        router = f"C matmul 16x128 {'gemv512' if matmul == 'gemv512' else 'gemv'}"
        assert {"C router top-k", f"C experts {kind}", router} <= set(chain._labels)
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    plain, _ = _run(tmp_path, dtype, quantization)
    for a, b in zip(chained, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("head", ["int4", "fp8"])
def test_a_quantized_head_of_another_scheme_runs_in_the_chain(
    tmp_path: Path, head: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--lm-head-quantization int4 / fp8 under int8 layers: the head in the chain, the same
    logits (so greedy tokens and logprobs) as the head run apart."""
    write_hf_model(tmp_path, **SHAPE)
    kw = dict(quantization="int8", lm_head_quantization=head)
    chained, chains = _run(tmp_path, torch.bfloat16, **kw)
    assert {c[3] for c in chains.values()} == {ModelConfig.from_dir(tmp_path).vocab_size}
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    plain, _ = _run(tmp_path, torch.bfloat16, **kw)
    for a, b in zip(chained, plain, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("rows", [1, 2, 40])
def test_a_quantized_head_gives_its_kernels_float32_sums(tmp_path: Path, rows: int) -> None:
    """A bf16 model's quantized LM head (tied, int8) writes the kernel's fp32 sums as the
    logits, as the chain's head call does, not sums rounded to bf16 and widened."""
    write_hf_model(tmp_path, **SHAPE)
    model = load(tmp_path, torch.bfloat16, quantization="int8", cpu_kernel_tuning="off")
    head = model.lm_head
    assert isinstance(head.weight, QuantWeight)
    x = torch.randn(rows, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(rows))
    x = x.to(torch.bfloat16)
    logits = head(x)
    want = qlinear(x, head.weight.whole(), head.weight.kernel, torch.float32)
    assert logits.dtype == torch.float32 and torch.equal(logits, want)
    assert not torch.equal(logits, logits.to(torch.bfloat16).float())


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("pick", ["dequant_panel", "int16_panel", "amx_panel", "amx_int"])
@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_chain_runs_each_quantized_pick(
    tmp_path: Path, quantization: str, pick: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every quantized candidate as every row count's pick (each falls back as its wrapper
    does where this CPU lacks its kernel): the chain calls what the wrapper calls."""
    monkeypatch.setattr(cpu_choice, "default_picks", lambda *a, **k: (pick,) * len(BUCKETS))
    write_hf_model(tmp_path, **SHAPE)
    chained, chains = _run(tmp_path, torch.bfloat16, quantization)
    assert chains and all(c is not None for c in chains.values())
    # The LM head (int8 per channel) with the same pick: in the chain too.
    assert {c[3] for c in chains.values()} == {ModelConfig.from_dir(tmp_path).vocab_size}
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    plain, _ = _run(tmp_path, torch.bfloat16, quantization)
    for a, b in zip(chained, plain, strict=True):
        assert torch.equal(a, b)


def test_a_pick_the_chain_does_not_express_runs_layer_by_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's F.linear as every float matmul: no chain, the same logits as without one."""
    monkeypatch.setenv("MINISGL_CPU_LINEAR", "torch")
    write_hf_model(tmp_path, **SHAPE)
    got, chains = _run(tmp_path, torch.bfloat16, None)
    assert chains and not any(chains.values())
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    plain, _ = _run(tmp_path, torch.bfloat16, None)
    for a, b in zip(got, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
def test_steps_past_16_rows_run_in_the_chain_on_shared_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 17 to 64 rows on the panels (bf16), decodes and short prompts, are chain steps
    too, the same logits as layer by layer; every chain's activations are the first rows of
    one set of MAX_ROWS-row buffers, so a server's chains for many batch sizes hold one set."""
    monkeypatch.setenv("MINISGL_CPU_LINEAR", "panel")
    dtype = torch.bfloat16
    write_hf_model(tmp_path, **SHAPE)
    n = 20
    schedule = [[3] * n, [1] * n, [1] * (n - 1) + [0], [1] * 3 + [0] * (n - 3)]
    seqs = prompts([6] * 3 + [5] * (n - 4) + [4], seed=3)

    def run() -> tuple[list[torch.Tensor], Any]:
        model = load(tmp_path, dtype, cpu_kernel_tuning="off")
        got = Runner(model, ModelConfig.from_dir(tmp_path), dtype).run(seqs, schedule)
        return got, model

    chained, model = run()
    chains = model.__dict__["_cpu_chains"]
    # the 20 prompts' first 3 tokens (60 rows), then 20, 19 and 3 decodes
    assert sorted(rows for rows, *_ in chains) == [3, n - 1, n, 3 * n]
    assert all(c is not None for c in chains.values())
    arena = model.__dict__["_cpu_chain_buffers"]
    assert all(t.shape[0] == cpu_chain.MAX_ROWS for t in arena.values())
    bases = {t.data_ptr() for t in arena.values()}
    for chain, out, residual, _ in chains.values():
        assert {out.data_ptr(), residual.data_ptr()} <= bases
        assert {t.data_ptr() for t in chain._buffers.values()} <= bases
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    plain, _ = run()
    for a, b in zip(chained, plain, strict=True):
        assert torch.equal(a, b)


def test_disabled_by_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    assert not cpu_chain.available(torch.bfloat16)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
def test_ids_the_chain_cannot_read_are_looked_up_by_the_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose token ids the chain's lookup does not take (ids_ok false: e.g. int32) runs
    the chain from after its lookup on the module's rows: the same logits."""
    write_hf_model(tmp_path, **SHAPE)
    kw = dict(quantization="int4")
    monkeypatch.setattr(cpu_chain, "ids_ok", lambda ids, rows: False)
    chained, chains = _run(tmp_path, torch.bfloat16, **kw)
    assert chains and all(c is not None and c[0].embedded is not None for c in chains.values())
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    plain, _ = _run(tmp_path, torch.bfloat16, **kw)
    for a, b in zip(chained, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
def test_a_quantized_head_whose_pick_is_no_c_call_runs_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int8 head (int4 layers) on dequant_gemm, chunks dequantized from Python: the layers
    in the chain, the final norm and the head after it, the same logits."""
    real = cpu_choice.default_picks

    def picks(
        kind: str | None = None, x_dtype: torch.dtype = torch.bfloat16, x8: bool = False
    ) -> tuple[str, ...]:
        return ("dequant_gemm",) * len(BUCKETS) if kind == "u8" else real(kind, x_dtype, x8)

    monkeypatch.setattr(cpu_choice, "default_picks", picks)
    write_hf_model(tmp_path, **SHAPE)
    chained, chains = _run(tmp_path, torch.bfloat16, "int4")
    assert chains and all(c is not None and c[3] == 0 for c in chains.values())
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    plain, _ = _run(tmp_path, torch.bfloat16, "int4")
    for a, b in zip(chained, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_timed_chain_gives_the_same_logits_and_times_each_op(
    tmp_path: Path, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpu_chain.timing (decode_step.py --breakdown): the same steps' logits as the plain
    call, and seconds for every kind of op the layers make, matmuls by shape."""
    write_hf_model(tmp_path, **SHAPE)
    plain, _ = _run(tmp_path, torch.bfloat16, quantization)
    monkeypatch.setattr(cpu_chain, "timing", {})
    timed, chains = _run(tmp_path, torch.bfloat16, quantization)
    for a, b in zip(timed, plain, strict=True):
        assert torch.equal(a, b)
    seen = cpu_chain.timing
    assert seen is not None and all(s >= 0 for s in seen.values())
    kinds = {"C norms", "C q/k norms + rotary", "C attention", "C SiLU x up"}
    assert kinds <= set(seen)
    hidden, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    vocab = ModelConfig.from_dir(tmp_path).vocab_size
    shapes = {f"{2 * inter}x{hidden}", f"{hidden}x{inter}", f"{vocab}x{hidden}"}
    for shape in shapes:
        assert any(k.startswith(f"C matmul {shape} ") for k in seen), (shape, sorted(seen))
    assert sum(seen.values()) > 0 and chains


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("chain", ["1", "0"])
def test_a_position_past_the_rotary_tables_runs_no_layer(
    tmp_path: Path, chain: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chain reads each row's rotary rows from the model's tables by position: a decode
    at a position past them is refused before any layer runs (the KV pool is left as it was,
    nothing is read out of bounds), and fails as the layer-by-layer step does."""
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", chain)
    write_hf_model(tmp_path, **SHAPE, max_position_embeddings=16)
    model = load(tmp_path, torch.bfloat16, quantization=None, cpu_kernel_tuning="off")
    runner = Runner(model, ModelConfig.from_dir(tmp_path), torch.bfloat16)
    table: list[int] = []
    runner.step([(table, 0, list(range(10, 25)))])  # positions 0..14
    runner.step([(table, 15, [3])])  # position 15: the table's last row
    chains = model.__dict__.get("_cpu_chains", {})
    assert any(c is not None for c in chains.values()) == (chain == "1")
    pools = [t.clone() for t in runner.pool.k_buffers + runner.pool.v_buffers]
    with pytest.raises(IndexError):
        runner.step([(table, 16, [4])])  # position 16: past it
    for before, after in zip(pools, runner.pool.k_buffers + runner.pool.v_buffers, strict=True):
        assert torch.equal(before, after)


def test_a_matmul_that_computed_nothing_is_raised_not_run_around() -> None:
    """decode_chain's answers: 0 ran; -1 refused before any layer ran (the caller runs the step
    its other way); -2 a matmul (the AMX one, or an expert's inside the one call) computed
    nothing part-way: the layers' buffers and KV rows are not the step's, so it is raised."""
    assert cpu_chain._ran(0) is True
    assert cpu_chain._ran(-1) is False
    with pytest.raises(RuntimeError, match="failed part-way"):
        cpu_chain._ran(-2)
