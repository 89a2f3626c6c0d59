"""--kv-cache-dtype fp8: the KV cache holds float8 e4m3 (each value rounded to the nearest,
clamped to +-448, no scales), attention computes in the model's dtype. The reference is
transformers' own Qwen3 on the same weights with its cache rounding keys and values the same
way, so greedy tokens must be identical: batched, after prefix-cache hits, in chunked
prefills, on the CPU decode kernel (which reads and stores e4m3 itself) and the PyTorch path."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.kvcache.kv_pool import FP8, KVPool, to_fp8
from minisgl.testing.fp8_reference import rounded, rounding_cache

MAX_TOKENS = 10


@lru_cache(maxsize=2)
def _hf(model_dir: str):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt: list[int], fp8: bool) -> list[int]:
    """transformers' greedy tokens, its cache rounding K and V to e4m3 where `fp8` (every
    attention then reads them rounded, the prompt's own too)."""
    model = _hf(model_dir)
    cache = rounding_cache(model.config) if fp8 else None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            cache=cache,
        )
    return out[0, len(prompt) :].tolist()


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(n)] for n in lengths]


def _check(model_dir: str, llm: LLM, prompts: list[list[int]]) -> None:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(model_dir, prompt, fp8=True), len(prompt)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> str:
    return str(tiny_model_dir)


def test_the_reference_sees_the_rounding(model_dir: str) -> None:
    """The fixture's keys and values are large enough that e4m3 rounding changes greedy
    tokens: the comparisons below tell an fp8 cache from a float one."""
    prompts = _prompts([7, 33, 100], seed=0)
    assert any(
        hf_greedy(model_dir, p, fp8=True) != hf_greedy(model_dir, p, fp8=False) for p in prompts
    )


@pytest.mark.parametrize("decode_kernel", [True, False], ids=["c-kernel", "pytorch"])
def test_greedy_tokens_equal_transformers_with_a_rounding_cache(
    model_dir: str, decode_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not decode_kernel:  # the PyTorch path: gathered rows widened, SDPA
        from minisgl.layers import cpu_kernels

        monkeypatch.setattr(cpu_kernels, "supports_decode_attention", lambda *a, **k: False)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_pages=256, kv_cache_dtype="fp8")
    assert llm.engine.runner.kv_pool.k_buffers[0].dtype == FP8
    _check(model_dir, llm, _prompts([1, 2, 7, 16, 17, 33, 64, 100, 150, 300], seed=1))
    # a shared long prefix, cached: the second batch reads its rows back from the cache
    prefix = _prompts([200], seed=2)[0]
    shared = [prefix + tail for tail in _prompts([5, 23], seed=3)]
    hits = llm.engine.stats().prefix_cache_hit_tokens_total
    _check(model_dir, llm, shared[:1])
    _check(model_dir, llm, shared)
    assert llm.engine.stats().prefix_cache_hit_tokens_total - hits >= 2 * 192


def test_chunked_prefill_reads_earlier_chunks_from_the_cache(model_dir: str) -> None:
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        num_pages=256,
        max_prefill_tokens=32,
        kv_cache_dtype="fp8_e4m3",
    )
    _check(model_dir, llm, _prompts([40, 77, 150], seed=4))


def test_an_fp8_page_costs_half_a_bf16_page() -> None:
    """Pages are sized by what the cache holds: the same memory holds twice the tokens."""
    args = (28, 16, 8, 128)
    assert 2 * KVPool.bytes_per_page(*args, FP8) == KVPool.bytes_per_page(*args, torch.bfloat16)
    pool = KVPool(2, 4, 16, 2, 64, torch.bfloat16, "cpu", cache_dtype=FP8)
    assert pool.k_buffers[0].dtype == pool.v_buffers[1].dtype == FP8
    assert pool.dtype == torch.bfloat16  # what attention computes in


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_store_rounds_to_nearest_and_clamps(
    path: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ties to even, subnormals, magnitudes past 448; the store gives back what it stored (what
    attention over the step's own rows reads), in the rows' dtype."""
    from minisgl.layers import cpu_kernels

    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "kv_store_supported", lambda *a: False)
    elif cpu_kernels.load() is None:
        pytest.skip("the CPU kernels do not build here")
    pool = KVPool(1, 2, 16, 1, 9, dtype, "cpu", cache_dtype=FP8)
    k = torch.tensor([[[0.0, 1.0, 1.0625, 1.1875, 500.0, -1e6, 2.0**-10, 3 * 2.0**-11, -3.3]]])
    k = k.to(dtype)
    k_back, v_back = pool.store(0, torch.tensor([5]), k, -k)
    want = torch.tensor([0.0, 1.0, 1.0, 1.25, 448.0, -448.0, 0.0, 2.0**-9, -3.25])
    assert torch.equal(pool.k_buffers[0][5, 0].float(), want)
    assert torch.equal(pool.v_buffers[0][5, 0].float(), -want)
    assert k_back.dtype == dtype and torch.equal(k_back.float()[0, 0], want)
    assert torch.equal(v_back.float()[0, 0], -want)
    assert torch.equal(to_fp8(k).float()[0, 0], want)


@pytest.mark.parametrize("prefix", [0, 40])
@pytest.mark.parametrize("new", [24, 100], ids=["rows", "prefill"])
def test_a_bf16_prefill_attends_to_rows_as_the_cache_gives_them_back(prefix: int, new: int) -> None:
    """A bf16 prompt after a cached prefix (the prefix read from the fp8 cache) and without
    one: a short one as decode-kernel rows, a long one on the CPU prefill kernel where this CPU
    has it (else SDPA), the same attention as fp32 over the rounded keys and values."""
    from minisgl.layers.attention import create_attention_backend
    from minisgl.layers.attention.base import BatchLayout

    hq, hkv, d = 4, 2, 64
    pool = KVPool(1, 16, 16, hkv, d, torch.bfloat16, "cpu", cache_dtype=FP8)
    attn = create_attention_backend("torch", pool, hq, hkv, d, d**-0.5)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(prefix + new, h, d, generator=gen) * 3 for h in (hq, hkv, hkv))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    pages = [5, 2, 7, 0, 11, 9, 14, 3, 1]
    if prefix:
        meta = attn.prepare(BatchLayout(16, [0], [prefix], [pages]))
        attn.forward(q[:prefix], k[:prefix], v[:prefix], 0, meta)
    meta = attn.prepare(BatchLayout(16, [prefix], [new], [pages]))
    got = attn.forward(q[prefix:], k[prefix:], v[prefix:], 0, meta).float()
    kr, vr = (rounded(t.float()).repeat_interleave(hq // hkv, 1).transpose(0, 1) for t in (k, v))
    mask = torch.ones(new, prefix + new, dtype=torch.bool).tril(prefix)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[prefix:].float().transpose(0, 1), kr, vr, attn_mask=mask, scale=d**-0.5
    )
    torch.testing.assert_close(got, want.transpose(0, 1).reshape(new, hq * d), atol=0.05, rtol=0.02)


def test_speculative_decoding_and_two_ranks_keep_the_tokens(model_dir: str) -> None:
    """Drafts verified over the fp8 cache (several rows a request through its rows path), and
    two tensor-parallel ranks each with its half of the heads' cache: the same tokens."""
    base = _prompts([40], seed=5)[0]
    prompts = [base * 3, _prompts([70], seed=6)[0]]  # the first repeats: ngram drafts hit
    params = SamplingParams(temperature=0, max_tokens=16)

    def tokens(**kw: object) -> list[list[int]]:
        llm = LLM(
            model_dir, dtype="float32", device="cpu", num_pages=128, kv_cache_dtype="fp8", **kw
        )
        try:
            return [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()

    want = tokens()
    assert tokens(speculative_algorithm="ngram") == want
    assert tokens(tp_size=2) == want


def test_the_blocked_attention_reads_an_fp8_cache_widened() -> None:
    """The torch backend's tiled attention (CUDA's masked calls) over an fp8 cache: the same
    as over its values widened to float32 beforehand."""
    import numpy as np

    from minisgl.layers.attention.tiles import attend_blocked, plan_tiles

    gen = torch.Generator().manual_seed(7)
    g, num_q, hq, hkv, d, keys = 2, 5, 4, 2, 16, 40
    k8, v8 = (to_fp8(torch.randn(64, hkv, d, generator=gen) * 3) for _ in range(2))
    qg = torch.randn(g, num_q, hq, d, generator=gen)
    k_slots = torch.stack([torch.randperm(64, generator=gen)[:keys] for _ in range(g)])
    hi = np.array([[keys - num_q + i for i in range(num_q)]] * g)  # causal over the prompt
    lo = np.zeros_like(hi)
    tiles = plan_tiles(lo, hi, 3, 16)
    lo_t, hi_t = torch.from_numpy(lo), torch.from_numpy(hi)
    got = attend_blocked(qg, k8, v8, k_slots, lo_t, hi_t, tiles, d**-0.5)
    want = attend_blocked(qg, k8.float(), v8.float(), k_slots, lo_t, hi_t, tiles, d**-0.5)
    torch.testing.assert_close(got, want)


def test_an_unknown_cache_dtype_is_refused_before_the_weights_load(model_dir: str) -> None:
    from minisgl.engine import model_runner

    def no_load(*a: object, **k: object) -> None:
        raise AssertionError("weights loaded before the KV cache dtype was checked")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "load_model", no_load)
        with pytest.raises(ValueError, match="choose from auto, fp8, fp8_e4m3"):
            LLM(model_dir, device="cpu", kv_cache_dtype="fp8_e5m2")
