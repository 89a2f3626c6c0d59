"""Our Qwen3 over the paged KV cache against transformers' Qwen3ForCausalLM on the same weights.

Checkpoints are written by transformers itself (random weights, std 0.5 so logits are far from
ties), and every step's logits are compared for every token, not just the last ones.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn.functional as F

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers.attention import create_attention_backend
from minisgl.layers.attention.base import BatchLayout
from minisgl.models.config import ModelConfig
from minisgl.models.loader import load_model, resolve_dtype, resolve_model_path
from minisgl.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    import transformers

VOCAB = 96
PAGE = 4


def write_hf_model(
    path: Path,
    tie: bool = True,
    shard: bool = False,
    seed: int = 0,
    moe: bool = False,
    **overrides: Any,
) -> transformers.Qwen3ForCausalLM:
    import transformers  # here, not at the top: spawned TP workers need not import it

    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        eos_token_id=5,
    )
    if moe:  # Qwen3-MoE: 16 experts, top 4, layer 1 dense
        kwargs.update(num_experts=16, num_experts_per_tok=4, mlp_only_layers=[1])
        kwargs.update(num_hidden_layers=3, moe_intermediate_size=32, norm_topk_prob=True)
    kwargs.update(overrides)
    config = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM)(config)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5)
    model.save_pretrained(path, max_shard_size="40KB" if shard else "1GB")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    return model


def hf_logits(model: transformers.Qwen3ForCausalLM, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


class Runner:
    """A minimal engine: requests with page tables drawn at random from a shuffled pool."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        config: ModelConfig,
        dtype: torch.dtype,
        tp_size: int = 1,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        heads, kv_heads = 4 // tp_size, 2 // tp_size
        self.pool = KVPool(
            config.num_hidden_layers, 64, PAGE, kv_heads, config.head_dim, dtype, "cpu", cache_dtype
        )
        self.attn = create_attention_backend(
            "torch", self.pool, heads, kv_heads, config.head_dim, config.head_dim**-0.5
        )
        self.free = list(range(64))
        random.Random(1).shuffle(self.free)

    def step(self, chunks: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """chunks: (page table (grown in place), prefix len, new tokens) per request; returns
        the logits of every new token, per request."""
        ids: list[int] = []
        positions: list[int] = []
        for table, prefix, new in chunks:
            while len(table) * PAGE < prefix + len(new):
                table.append(self.free.pop())
            ids += new
            positions += range(prefix, prefix + len(new))
        layout = BatchLayout(
            PAGE, [c[1] for c in chunks], [len(c[2]) for c in chunks], [c[0] for c in chunks]
        )
        meta = self.attn.prepare(layout)
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(ids),
                torch.tensor(positions),
                self.attn,
                meta,
                torch.arange(len(ids)),
            )
        vocab = self.model.config.vocab_size
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), vocab)
        return list(logits.split([len(c[2]) for c in chunks]))

    def run(self, seqs: list[list[int]], schedule: list[list[int]]) -> list[torch.Tensor]:
        """schedule[s][i]: tokens request i adds at step s (0: sits the step out)."""
        tables: list[list[int]] = [[] for _ in seqs]
        done = [0] * len(seqs)
        out: list[list[torch.Tensor]] = [[] for _ in seqs]
        for sizes in schedule:
            active = [i for i, n in enumerate(sizes) if n]
            chunks = [(tables[i], done[i], seqs[i][done[i] : done[i] + sizes[i]]) for i in active]
            for i, logits in zip(active, self.step(chunks), strict=True):
                out[i].append(logits)
                done[i] += sizes[i]
        assert done == [len(s) for s in seqs]
        return [torch.cat(o) for o in out]


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(VOCAB - 1) for _ in range(n)] for n in lengths]


def load(path: Path, dtype: torch.dtype = torch.float32, **kw: Any) -> Qwen3ForCausalLM:
    return load_model(path, ModelConfig.from_dir(path), dtype, torch.device("cpu"), **kw)


@pytest.mark.parametrize("tie", [True, False])
def test_batched_prefill_matches_transformers(tmp_path: Path, tie: bool) -> None:
    hf = write_hf_model(tmp_path, tie=tie)
    config = ModelConfig.from_dir(tmp_path)
    assert config.tie_word_embeddings is tie and config.eos_token_ids == [5, 7]
    seqs = prompts([1, 6, 17, 33, 9])
    got = Runner(load(tmp_path), config, torch.float32).run(seqs, [[len(s) for s in seqs]])
    for seq, logits in zip(seqs, got, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


def test_prefix_then_chunks_then_decode_match_transformers(tmp_path: Path) -> None:
    """A request's logits do not depend on how its tokens were split into steps, nor on
    which other requests (prefilling or decoding) share those steps."""
    hf = write_hf_model(tmp_path, tie=False, shard=True)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    seqs = prompts([14, 11, 23, 5], seed=3)
    schedule = [
        [3, 0, 9, 2],  # prefixes; request 1 waits
        [6, 7, 1, 1],  # extends crossing page boundaries next to decodes
        [1, 1, 6, 1],
        [1, 1, 1, 1],  # all decode
        [1, 2, 6, 0],
        [2, 0, 0, 0],
    ]
    got = Runner(load(tmp_path), ModelConfig.from_dir(tmp_path), torch.float32).run(seqs, schedule)
    for seq, logits in zip(seqs, got, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


MATMULS = ["measured", "gemv", "gemv512", "amx", "gemm", "torch", "panel", "onednn"]


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_fast_path_agrees_with_pure_pytorch(
    tmp_path: Path, dtype: torch.dtype, matmul: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU kernels (matmul, norm, decode attention) against the plain PyTorch path, over a
    prefill step and decode steps: with the matmuls the chooser measured fastest, and with each
    candidate forced for every row count (where this CPU can run it)."""
    from minisgl.layers import cpu_kernels

    if matmul != "measured":
        monkeypatch.setenv("MINISGL_CPU_LINEAR", matmul)

    write_hf_model(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    seqs = prompts([7, 12])
    schedule = [[5, 9], [1, 1], [1, 1], [0, 1]]
    fast = Runner(load(tmp_path, dtype), config, dtype).run(seqs, schedule)
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "load", lambda: None)
        plain = Runner(load(tmp_path, dtype), config, dtype).run(seqs, schedule)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("tie", [True, False])
def test_panel_layout_leaves_one_copy_of_each_weight(
    tmp_path: Path, tie: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every row count runs on the panels, they are the only copy of a layer's weight
    (the original keeps its shape on the meta device), a tied embedding looks its rows up in
    the head's panels, and the logits still match the plain path."""
    from minisgl.layers import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no CPU kernels here")
    monkeypatch.setenv("MINISGL_CPU_LINEAR", "panel")
    write_hf_model(tmp_path, tie=tie)
    config = ModelConfig.from_dir(tmp_path)
    model = load(tmp_path, torch.bfloat16)
    embed = model.model.embed_tokens
    matmuls = [m for m in model.modules() if hasattr(m, "kernel_out_dtype")]
    assert matmuls and all(m.weight.device.type == "meta" for m in matmuls)
    assert (embed.weight.device.type == "meta") is tie and (embed.panels is not None) is tie
    ids = torch.tensor([[0, 15, 16, 17], [VOCAB - 1, 3, 8, 7]])
    if tie:
        rows = cpu_kernels.panel_rows(embed.panels, ids)
        assert rows.shape == (2, 4, 64)
    seqs = prompts([7, 12])
    schedule = [[5, 9], [1, 1], [1, 1], [0, 1]]
    fast = Runner(model, config, torch.bfloat16).run(seqs, schedule)
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "load", lambda: None)
        plain_model = load(tmp_path, torch.bfloat16)
        plain = Runner(plain_model, config, torch.bfloat16).run(seqs, schedule)
    if tie:
        torch.testing.assert_close(rows, plain_model.model.embed_tokens.weight[ids])
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2 * b.abs().max().item(), rtol=5e-2)


def _copies_held(model: Qwen3ForCausalLM) -> list[int]:
    """Per matmul: how many copies of its weight it keeps (the row-major one unless on the
    meta device, plus each packed layout)."""
    out = []
    for m in model.modules():
        if hasattr(m, "kernel_out_dtype"):
            packed = len(m.kernel.packed) if m.kernel is not None else 0
            out.append(int(m.weight.device.type != "meta") + packed)
    return out


@pytest.mark.parametrize("tie", [True, False])
def test_no_second_weight_copy_unless_asked_for(
    tmp_path: Path, tie: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timings where panels win prefill and the row-major GEMV decode (a second copy would pay):
    by default every weight is still in memory once, and the logits match the plain path;
    with --cpu-weight-copies-max-gb room, the layers keep both layouts."""
    from minisgl.layers import cpu_kernels, cpu_linear
    from minisgl.layers.kernel_choice import BUCKETS

    if cpu_kernels.load() is None:
        pytest.skip("no CPU kernels here")
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_linear, "_MEMO", {})
    fast = ["gemv"] * 4 + ["panel"] * (len(BUCKETS) - 4)

    def measure(weights, x_dtype, out_dtype, avail, spreads=None):  # noqa: ANN001, ANN202
        return {
            n: [(1.0 if fast[b] == n else 3.0) if n in avail else None for b in range(len(BUCKETS))]
            for n in cpu_linear.CANDIDATES
        }

    monkeypatch.setattr(cpu_linear, "measure", measure)
    write_hf_model(tmp_path, tie=tie)
    config = ModelConfig.from_dir(tmp_path)
    once = load(tmp_path, torch.bfloat16)
    assert set(_copies_held(once)) == {1}
    twice = load(tmp_path, torch.bfloat16, cpu_weight_copies_max_gb=1.0)
    assert set(_copies_held(twice)) == {2}
    with pytest.raises(ValueError, match="cpu_weight_copies_max_gb"):
        load(tmp_path, torch.bfloat16, cpu_weight_copies_max_gb=-1.0)
    seqs = prompts([7, 12])
    schedule = [[5, 9], [1, 1], [1, 1], [0, 1]]
    got = Runner(once, config, torch.bfloat16).run(seqs, schedule)
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "load", lambda: None)
        plain = Runner(load(tmp_path, torch.bfloat16), config, torch.bfloat16).run(seqs, schedule)
    for a, b in zip(got, plain, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2 * b.abs().max().item(), rtol=5e-2)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=lambda s: s["rope_type"],
)
def test_rope_scaling_matches_transformers(tmp_path: Path, scaling: dict[str, Any]) -> None:
    hf = write_hf_model(tmp_path, rope_parameters={"rope_theta": 10000.0, **scaling})
    config = ModelConfig.from_dir(tmp_path)
    assert (
        config.rope_scaling is not None and config.rope_scaling["rope_type"] == scaling["rope_type"]
    )
    seqs = prompts([40, 3], seed=5)
    got = Runner(load(tmp_path), config, torch.float32).run(seqs, [[30, 3], [10, 0]])
    for seq, logits in zip(seqs, got, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


def test_bfloat16_loads_and_tracks_transformers(tmp_path: Path) -> None:
    hf = write_hf_model(tmp_path, tie=False)
    config = ModelConfig.from_dir(tmp_path)
    assert resolve_dtype("bfloat16", config) == torch.bfloat16
    model = load(tmp_path, torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    seqs = prompts([10, 4], seed=2)
    got = Runner(model, config, torch.bfloat16).run(seqs, [[6, 4], [4, 0]])
    hf = hf.bfloat16()
    for seq, logits in zip(seqs, got, strict=True):
        want = hf_logits(hf, seq)
        # bf16 keeps ~3 significant digits; the argmax must agree where the margin is clear.
        scale = want.abs().max()
        assert (logits - want).abs().max() < 0.05 * scale
        top2 = want.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
        assert torch.equal(logits.argmax(-1)[clear], want.argmax(-1)[clear])


def test_auto_dtype_follows_the_checkpoint(tmp_path: Path) -> None:
    write_hf_model(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["dtype"] = "bfloat16"
    assert resolve_dtype("auto", ModelConfig.from_dict(raw)) == torch.bfloat16
    raw["dtype"] = "float16"
    assert resolve_dtype("auto", ModelConfig.from_dict(raw), torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", ModelConfig.from_dict(raw)) == torch.float32


def test_missing_files_and_tensors_are_named(tmp_path: Path) -> None:
    write_hf_model(tmp_path / "sharded", shard=True)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "sharded" / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        load(tmp_path / "sharded")

    write_hf_model(tmp_path / "single", tie=False)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "single" / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "single" / "model.safetensors")
    # Told against config.json, before any weight is read.
    with pytest.raises(
        ValueError, match=r"layer 1 dense .* no tensor model\.layers\.1\.mlp\.down_"
    ):
        load(tmp_path / "single")

    (tmp_path / "single" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load(tmp_path / "single")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    write_hf_model(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"] = ["MistralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    supported = "Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM"
    with pytest.raises(ValueError, match=f"MistralForCausalLM.*{supported}"):
        ModelConfig.from_dir(tmp_path)


def test_unknown_model_names_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="nobody/no-such-model"):
        resolve_model_path("nobody/no-such-model")
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        resolve_model_path(str(tmp_path / "does-not-exist"))
    assert resolve_model_path(str(tmp_path)) == tmp_path


def _tp_worker(path: str, rank: int, init: str, seqs: list[list[int]], queue: Any) -> None:
    from minisgl import distributed

    torch.set_num_threads(1)
    distributed.init_distributed(rank, 2, init, device="cpu")
    try:
        config = ModelConfig.from_dir(path)
        model = load_model(Path(path), config, torch.float32, torch.device("cpu"), rank, 2)
        got = Runner(model, config, torch.float32, tp_size=2).run(seqs, [[4, 9], [5, 1]])
        if rank == 0:
            queue.put([t.tolist() for t in got])
    finally:
        distributed.destroy_distributed()


def test_tensor_parallel_two_ranks_match_transformers(tmp_path: Path) -> None:
    """Column/row-parallel linears, vocab-parallel embedding and head, KV heads split: two gloo
    ranks together compute what one model does."""
    import multiprocessing as mp

    hf = write_hf_model(tmp_path / "m", tie=False, vocab_size=VOCAB - 1)  # uneven vocab split
    seqs = prompts([9, 10], seed=4)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        ctx.Process(target=_tp_worker, args=(str(tmp_path / "m"), r, init, seqs, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for seq, logits in zip(seqs, got, strict=True):
        want = hf_logits(hf, seq)
        torch.testing.assert_close(torch.tensor(logits), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_fast_matmul_matches_linear(
    dtype: torch.dtype, matmul: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fast path this CPU gets (measured, or each candidate forced) computes x @ W.T
    for decode-sized and prefill-sized inputs and odd output sizes."""
    from minisgl.layers.cpu_linear import CpuLinearKernel

    if matmul != "measured":
        monkeypatch.setenv("MINISGL_CPU_LINEAR", matmul)

    g = torch.Generator().manual_seed(0)
    for n, k in [(1, 8), (5, 64), (130, 1024)]:
        w = torch.randn(n, k, generator=g).to(dtype)
        for m in (1, 2, 3, 5, 16, 17, 70):
            x = torch.randn(m, k, generator=g).to(dtype)
            want = F.linear(x.float(), w.float())
            for out_dtype in (None, torch.float32):
                kernel = CpuLinearKernel.create(w, out_dtype)
                got = kernel(x) if kernel is not None else F.linear(x, w).to(out_dtype or dtype)
                assert got.dtype == (out_dtype or dtype) and got.shape == (m, n)
                tol = 1e-4 if got.dtype == torch.float32 and dtype == torch.float32 else 1e-2
                torch.testing.assert_close(got.float(), want, atol=tol * k**0.5, rtol=tol)
