"""The prefill attention kernel (csrc/attention.c prefill_attn, cpu_prefill.py) in each form
the CPU here has: AMX tiles, or VDPBF16PS register tiles on AVX512-BF16 without AMX (AMD Zen 4),
against torch's SDPA in fp32."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers import cpu_build, cpu_kernels
from minisgl.layers.attention import cpu_prefill, create_attention_backend
from minisgl.layers.attention.base import BatchLayout
from minisgl.models.config import ModelConfig
from minisgl.models.loader import load_model
from minisgl.testing import builds
from minisgl.testing.threads import at_thread_counts

HQ, HKV = 16, 8  # Qwen3-0.6B's GQA


def _forms_here() -> list[int]:
    """The forms a call can take here, best first (2 AMX, 1 VDPBF16PS); none: []."""
    return list(range(cpu_prefill.form(), 0, -1))


@contextmanager
def _picked(form: int) -> Iterator[None]:
    switch = cpu_prefill.pick()
    assert switch is not None
    saved = switch.value
    switch.value = form
    try:
        yield
    finally:
        switch.value = saved


def test_the_kernel_runs_wherever_the_cpu_has_avx512_bf16() -> None:
    """Not only on AMX: the AVX-512 build on a CPU with AVX512-BF16 takes bf16 prefills of
    head dims 64 and 128 (Qwen3-0.6B: 16 query heads over 8 KV heads); without it, SDPA."""
    _, flags = cpu_build.cpu_info()
    built = cpu_kernels.load() is not None and cpu_kernels._isa() == "avx512"
    want = built and "avx512_bf16" in flags
    for d in (64, 128):
        assert cpu_prefill.available(torch.bfloat16, d, HQ, HKV) == want
    assert not cpu_prefill.available(torch.bfloat16, 96, HQ, HKV)
    assert not cpu_prefill.available(torch.float32, 128, HQ, HKV)
    assert (cpu_prefill.form() >= 1) == want


def _problem(
    d: int, lens: list[int], pres: list[int], seed: int
) -> tuple[tuple[torch.Tensor, ...], cpu_prefill.Plan, torch.Tensor]:
    """Random bf16 q/k/v rows of prompts `lens` after cached prefixes `pres` (pool slots in a
    random order), the kernel's plan, and SDPA's answer in fp32."""
    g = torch.Generator().manual_seed(seed)
    t, slots = sum(lens), 300
    q = torch.randn(t, HQ, d, generator=g).bfloat16()
    k, v = (torch.randn(t, HKV, d, generator=g).bfloat16() for _ in range(2))
    k_pool, v_pool = (torch.randn(slots, HKV, d, generator=g).bfloat16() for _ in range(2))
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    rows = torch.stack([starts, starts, torch.tensor(lens)]).long()
    order = torch.randperm(slots, generator=g)[: sum(pres)].long()
    ofs = torch.tensor([0, *pres[:-1]]).cumsum(0)
    plan = cpu_prefill.Plan(rows, None, None)
    if any(pres):
        plan = cpu_prefill.Plan(rows, torch.stack([torch.tensor(pres), ofs]).long(), order)
    want = []
    for s, e, p, o in zip(starts.tolist(), lens, pres, ofs.tolist(), strict=True):
        kk = torch.cat([k_pool[order[o : o + p]], k[s : s + e]]).float().transpose(0, 1)
        vv = torch.cat([v_pool[order[o : o + p]], v[s : s + e]]).float().transpose(0, 1)
        seen = torch.arange(p + e)[None, :] <= torch.arange(e)[:, None] + p
        o_ = F.scaled_dot_product_attention(
            q[s : s + e].float().transpose(0, 1), kk, vv, seen, scale=d**-0.5, enable_gqa=True
        )
        want.append(o_.transpose(0, 1).reshape(e, HQ * d))
    return (q, k, v, k_pool, v_pool), plan, torch.cat(want)


CASES = {
    "one 512-token prompt": ([512], [0]),
    "four 128-token prompts": ([128] * 4, [0] * 4),
    "lengths off the tiles": ([37, 1, 100, 16, 33, 65], [0] * 6),
    "after cached prefixes": ([37, 1, 100, 16, 33], [0, 5, 40, 0, 17]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", [64, 128])
def test_each_form_matches_sdpa_at_one_and_two_threads(case: str, d: int) -> None:
    """Every form here within bf16 rounding of SDPA's fp32 answer, the same bits at 1 and 2
    threads (a row's sums do not depend on how the rows are split); without a form the call
    is refused and writes nothing (the backend's SDPA then runs)."""
    lens, pres = CASES[case]
    tensors, plan, want = _problem(d, lens, pres, seed=d + len(lens))
    out = torch.full((sum(lens), HQ * d), 7.0, dtype=torch.bfloat16)
    if not _forms_here():
        assert not cpu_prefill.attend(*tensors, plan, out, d**-0.5)
        assert bool((out == 7.0).all())
        return
    for form in _forms_here():

        def run() -> torch.Tensor:
            res = torch.zeros_like(out)
            assert cpu_prefill.attend(*tensors, plan, res, d**-0.5)
            return res

        with _picked(form):
            one, two = at_thread_counts(run)
        torch.testing.assert_close(one.float(), want, atol=2e-2, rtol=2e-2)
        assert torch.equal(one, two)


@pytest.mark.parametrize("case", list(CASES))
def test_amx_items_of_two_query_blocks_give_one_block_s_bits(case: str) -> None:
    """On AMX an item multiplies two 16-row query blocks at once (each key and value tile
    loaded once for both): the same products in the same order as a block at a time, so the
    same bits, whatever the blocks' lengths (a last block alone, prompts off the tiles,
    cached prefixes)."""
    if cpu_prefill.form() < 2:
        pytest.skip("no AMX tiles here: the VDPBF16PS form takes a block at a time")
    lens, pres = CASES[case]
    for d in (64, 128):
        tensors, plan, _ = _problem(d, lens, pres, seed=3 * d + len(lens))
        switch = cpu_prefill.pairs()
        assert switch is not None and switch.value == 1
        got = {}
        try:
            for pairs in (1, 0):
                switch.value = pairs
                got[pairs] = torch.zeros(sum(lens), HQ * d, dtype=torch.bfloat16)
                assert cpu_prefill.attend(*tensors, plan, got[pairs], d**-0.5)
        finally:
            switch.value = 1
        assert torch.equal(got[1], got[0])


def test_the_switch_turns_the_kernel_off() -> None:
    """prefill_attn_pick 0 (benchmarks' "before"): refused, nothing written."""
    if not _forms_here():
        assert cpu_prefill.pick() is None or cpu_prefill.form() == 0
        return
    tensors, plan, _ = _problem(64, [20], [0], seed=1)
    out = torch.full((20, HQ * 64), 7.0, dtype=torch.bfloat16)
    with _picked(0):
        assert cpu_prefill.form() == 0
        assert not cpu_prefill.attend(*tensors, plan, out, 0.125)
    assert bool((out == 7.0).all())
    assert cpu_prefill.attend(*tensors, plan, out, 0.125)


def test_a_bf16_model_s_prefill_on_the_kernel_tracks_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 Qwen3 with head dim 64 (the kernel's shape: prompts off the 16-row tiles, one
    after a cached prefix): every prompt position's logits within bf16 rounding of
    transformers' on the same weights, the argmax the same where the margin is clear; and the
    prompts' attention went through the kernel wherever this CPU has a form of it."""
    import transformers

    hf_config = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    model = load_model(tmp_path, config, torch.bfloat16, torch.device("cpu"))
    pool = KVPool(2, 64, 4, 2, 64, torch.bfloat16, "cpu")
    attn = create_attention_backend("torch", pool, 4, 2, 64, 64**-0.5)
    calls: list[bool] = []
    attend = cpu_prefill.attend
    monkeypatch.setattr(cpu_prefill, "attend", lambda *a: calls.append(attend(*a)) or calls[-1])
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 95, (n,), generator=g).tolist() for n in (45, 70, 90)]
    # Step 1: prompts 0 and 1, and the first 20 tokens of prompt 2; step 2: its other 70 (more
    # rows than a short extend's, which the decode kernel attends row by row).
    steps = [[(0, 0, 45), (1, 0, 70), (2, 0, 20)], [(2, 20, 70)]]
    tables = [list(range(0, 12)), list(range(12, 30)), list(range(30, 53))]
    got: list[list[torch.Tensor]] = [[], [], []]
    for step in steps:
        ids = [t for i, pre, n in step for t in seqs[i][pre : pre + n]]
        pos = [p for _, pre, n in step for p in range(pre, pre + n)]
        layout = BatchLayout(
            4, [s[1] for s in step], [s[2] for s in step], [tables[s[0]] for s in step]
        )
        meta = attn.prepare(layout)
        with torch.inference_mode():
            logits = model(torch.tensor(ids), torch.tensor(pos), attn, meta, torch.arange(len(ids)))
        for (i, _, _), rows in zip(step, logits.split([s[2] for s in step]), strict=True):
            got[i].append(rows.float())
    assert calls == ([True] * 4 if _forms_here() else [])  # 2 steps x 2 layers
    hf = hf.bfloat16()
    for seq, rows in zip(seqs, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0].float()
        logits, scale = torch.cat(rows), want.abs().max()
        assert (logits - want).abs().max() < 0.05 * scale
        top2 = want.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
        assert torch.equal(logits.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_builds_without_amx_take_the_form_their_flags_allow(tmp_path: Path, isa: str) -> None:
    """attention.c built for this CPU less AMX: the AVX2 build has no form (its backend keeps
    SDPA), the AVX-512 one the VDPBF16PS form exactly where the CPU has AVX512-BF16."""
    lib = builds.without_amx("attention.c", isa, tmp_path)
    if lib is None:
        pytest.skip("no C compiler here")
    _, flags = cpu_build.cpu_info()
    if isa == "avx512" and not flags >= cpu_build.AVX512_NEEDS:
        return  # it compiled; this CPU cannot run it
    want = 1 if isa == "avx512" and "avx512_bf16" in flags else 0
    assert lib.prefill_attn_form() == want
