"""The paged torch attention backend against a naive per-request reference."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers import attention
from minisgl.layers.attention import cpu_prefill, create_attention_backend, resolve_backend_name
from minisgl.layers.attention.base import BatchLayout, check_page_tables
from minisgl.layers.attention.paged_plan import build_paged_plan
from minisgl.layers.attention.torch_backend import TorchAttentionBackend

D = 8
PAGE = 4
NUM_PAGES = 96


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """q [n, Hq, D] of positions prefix.., k/v [prefix + n, Hkv, D] -> [n, Hq * D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * D**-0.5
    q_pos = torch.arange(q.shape[0])[:, None] + prefix
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())
    return out.reshape(q.shape[0], -1).float()


PATHS = ["cpu-kernel", "pure-torch", "blocked"]


def force_path(attn: object, path: str) -> None:
    assert isinstance(attn, TorchAttentionBackend) and path in PATHS
    if path != "cpu-kernel":
        attn.cpu_decode = False
        attn.sdpa_mask_cells, attn.sdpa_q_tile_min = 256, 1
    if path == "blocked":
        attn.sdpa_masked = attn.sdpa_plain = False
        attn.q_tile, attn.tile_cells = 5, 64


def run_case(
    prefix: list[int],
    extend: list[int],
    hq: int,
    hkv: int,
    seed: int,
    path: str = "cpu-kernel",
    dtype: torch.dtype = torch.float32,
) -> None:
    """path: "cpu-kernel" (the CPU defaults), "pure-torch" (no C kernel for single-query groups;
    SDPA's masks split into tiles of a few queries), "blocked" (every call in tiles of a few
    queries and 16 keys with the online softmax, as CUDA runs masked calls)."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(2, NUM_PAGES, PAGE, hkv, D, dtype, "cpu")
    attn = create_attention_backend("torch", pool, hq, hkv, D, D**-0.5)
    force_path(attn, path)
    free = list(range(NUM_PAGES))
    random.Random(seed).shuffle(free)
    tables, past_k, past_v = [], [], []
    for p, e in zip(prefix, extend, strict=True):
        tables.append([free.pop() for _ in range(-(-(p + e) // PAGE))])
        # The cached prefix, written where the slot formula says it lives.
        pk = torch.randn(p, hkv, D, generator=g).to(dtype)
        pv = torch.randn(p, hkv, D, generator=g).to(dtype)
        slots = torch.tensor([tables[-1][i // PAGE] * PAGE + i % PAGE for i in range(p)])
        for layer in range(2):
            pool.k_buffers[layer][slots.long()] = pk * (layer + 1)
            pool.v_buffers[layer][slots.long()] = pv * (layer + 1)
        past_k.append(pk)
        past_v.append(pv)
    t = sum(extend)
    q, k, v = (torch.randn(t, h, D, generator=g).to(dtype) for h in (hq, hkv, hkv))
    meta = attn.prepare(BatchLayout(PAGE, prefix, extend, tables))
    for layer in range(2):  # the metadata serves every layer
        out = attn.forward(q, k, v, layer, meta)
        assert out.shape == (t, hq * D)
        start = 0
        for i, (p, e) in enumerate(zip(prefix, extend, strict=True)):
            rows = slice(start, start + e)
            full_k = torch.cat([past_k[i] * (layer + 1), k[rows]])
            full_v = torch.cat([past_v[i] * (layer + 1), v[rows]])
            want = reference(q[rows].float(), full_k.float(), full_v.float(), p)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[rows].float(), want, atol=tol, rtol=tol)
            start += e
    # The new tokens' K/V are in the pool at their slots.
    start = 0
    for i, (p, e) in enumerate(zip(prefix, extend, strict=True)):
        new_slots = [tables[i][j // PAGE] * PAGE + j % PAGE for j in range(p, p + e)]
        torch.testing.assert_close(pool.v_buffers[1][new_slots], v[start : start + e])
        start += e


CASES = {
    "decode-same-length": ([5, 5, 5], [1, 1, 1]),
    "decode-mixed-lengths": ([0, 3, 17, 40], [1, 1, 1, 1]),
    "single-prefill": ([0], [13]),
    "single-extend-on-prefix": ([6], [9]),
    "prefills-mixed": ([0, 0, 0], [2, 11, 5]),
    "one-long-many-short (packed)": ([0, 0, 2, 0, 0], [60, 2, 3, 2, 2]),
    "mixed-prefill-and-decode": ([0, 7, 12, 0, 30], [9, 1, 4, 1, 1]),
    "chunks-crossing-pages": ([3, 4, 5], [6, 9, 2]),
    "long-prefills (per request)": ([0, 0, 20, 0], [40, 35, 30, 38]),
    "long-prefills-and-decodes (per request)": ([0, 5, 20, 0, 9], [40, 1, 30, 38, 1]),
    "equal-fresh-prompts (one call)": ([0, 0, 0, 6, 0, 0], [30, 30, 30, 30, 24, 24]),
    "equal-fresh-prompts-and-decodes": ([0, 0, 9, 0, 0], [28, 28, 1, 28, 28]),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(case: str, heads: tuple[int, int], path: str) -> None:
    prefix, extend = CASES[case]
    run_case(prefix, extend, *heads, seed=len(case), path=path)


@pytest.mark.parametrize("path", PATHS)
def test_bfloat16_pool(path: str) -> None:
    run_case([0, 9, 3, 0], [1, 1, 7, 12], 4, 2, seed=9, path=path, dtype=torch.bfloat16)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_reference(seed: int) -> None:
    r = random.Random(seed)
    n = r.randint(1, 7)
    prefix = [r.choice([0, r.randint(1, 30)]) for _ in range(n)]
    extend = [r.choice([1, r.randint(1, 25)]) for _ in range(n)]
    run_case(prefix, extend, 4, 2, seed, path=PATHS[seed % 3])


def _planned_group(case: str) -> Any:  # the backend's private _Group
    """The one group of calls the torch backend plans for CASES[case] (pages in order)."""
    pool = KVPool(1, NUM_PAGES, PAGE, 2, D, torch.float32, "cpu")
    attn = create_attention_backend("torch", pool, 4, 2, D, D**-0.5)
    prefix, extend = CASES[case]
    tables, free = [], iter(range(NUM_PAGES))
    for p, e in zip(prefix, extend, strict=True):
        tables.append([next(free) for _ in range(-(-(p + e) // PAGE))])
    meta = attn.prepare(BatchLayout(PAGE, prefix, extend, tables))
    (group,) = meta.groups  # type: ignore[attr-defined]
    return group


def test_long_prefills_are_attended_per_request() -> None:
    """The layout the cases above rely on: a chunk of long prompts is not padded to a
    rectangle."""
    extend = CASES["long-prefills (per request)"][1]
    group = _planned_group("long-prefills (per request)")
    assert [c.shape for c in group.calls] == [(1, e) for e in extend]
    # Without a cached prefix: SDPA's own causal mask, no tiles.
    assert [c.causal and not c.tiles for c in group.calls] == [True, True, False, True]


def test_fresh_prompts_attend_over_their_own_rows() -> None:
    """Prompts without a cached prefix read their keys from the step's K/V, not gathered back
    from the pool (no slots), and equal ones next to each other share one causal call; a chunk
    after a cached prefix still reads the pool."""
    group = _planned_group("equal-fresh-prompts (one call)")
    calls = [(c.shape, c.start, c.k_slots is None, c.causal) for c in group.calls]
    assert calls == [
        ((3, 30), 0, True, True),
        ((1, 30), 90, False, False),
        ((2, 24), 120, True, True),
    ]
    assert group.out_rows is None  # in step order: no scatter of the outputs


@pytest.mark.parametrize("refuse", [False, True], ids=["kernel", "refused"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefills_at_model_head_sizes_match_the_reference(
    head_dim: int, refuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 prompts at a model's head size (where the CPU has AMX: the tile kernel,
    cpu_prefill.py), fresh and after a cached prefix, lengths off the 16-row tiles, beside a
    decode; the same answers as the reference within bf16 rounding."""
    hq, hkv, ps = 4, 2, 16
    prefix, extend = [0, 0, 3, 0, 20, 0, 37], [40, 17, 1, 130, 18, 33, 64]
    pool = KVPool(1, 96, ps, hkv, head_dim, torch.bfloat16, "cpu")
    attn = create_attention_backend("torch", pool, hq, hkv, head_dim, head_dim**-0.5)
    assert isinstance(attn, TorchAttentionBackend)
    free = iter(range(96))
    tables = [[next(free) for _ in range(-(-(p + e) // ps))] for p, e in zip(prefix, extend)]
    g = torch.Generator().manual_seed(head_dim)
    past = [torch.randn(2, p, hkv, head_dim, generator=g).bfloat16() for p in prefix]
    for (pk, pv), table, p in zip(past, tables, prefix, strict=True):
        slots = [table[i // ps] * ps + i % ps for i in range(p)]
        pool.k_buffers[0][slots], pool.v_buffers[0][slots] = pk, pv
    t = sum(extend)
    # As a model hands them over: q and k views of the normed q/k rows, v of the projection's.
    qk = torch.randn(t, (hq + hkv) * head_dim, generator=g).bfloat16()
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g).bfloat16()
    q, k = qk.view(t, hq + hkv, head_dim).split([hq, hkv], dim=1)
    v = qkv.view(t, hq + 2 * hkv, head_dim)[:, hq + hkv :]
    meta = attn.prepare(BatchLayout(ps, prefix, extend, tables))
    kernel = cpu_prefill.available(torch.bfloat16, head_dim, hq, hkv)
    plans = [grp.prefill_plan for grp in meta.groups]  # type: ignore[attr-defined]
    assert [p is not None for p in plans] == [False, kernel]  # the decode's group, the prompts'
    if plans[1] is not None:  # the kernel takes these views (no silent fall back to SDPA)
        kv = pool.k_buffers[0], pool.v_buffers[0]
        assert cpu_prefill.attend(q, k, v, *kv, plans[1], q.new_empty(t, hq * head_dim), 0.1)
    if refuse:
        monkeypatch.setattr(cpu_prefill, "attend", lambda *a: False)
    out = attn.forward(q, k, v, 0, meta).float()
    if refuse:  # the kernel refuses these tensors: the group's SDPA calls, for every layer
        assert meta.groups[1].prefill_plan is None and meta.groups[1].calls  # type: ignore[attr-defined]
    start = 0
    for (pk, pv), p, e in zip(past, prefix, extend, strict=True):
        rows = slice(start, start + e)
        full_k, full_v = torch.cat([pk, k[rows]]).double(), torch.cat([pv, v[rows]]).double()
        group = hq // hkv
        kk, vv = full_k.repeat_interleave(group, 1), full_v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), kk) * head_dim**-0.5
        hidden = torch.arange(p + e)[None, :] > torch.arange(e)[:, None] + p
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        want = torch.einsum("hqk,khd->qhd", probs, vv).reshape(e, -1).float()
        torch.testing.assert_close(out[rows], want, atol=2e-2, rtol=2e-2)
        start += e


def test_decodes_at_chat_contexts_and_model_heads_match_the_reference() -> None:
    """Decodes as a chat serves them: Qwen3-0.6B's heads (16 query heads over 8 KV heads of
    128), bf16, contexts of 1-2k tokens on shuffled pages beside short ones, through the decode
    kernel (each long request split into key chunks whose partial softmaxes are merged); the
    same answers as the reference within bf16 rounding."""
    hq, hkv, hd, ps = 16, 8, 128, 16
    prefix = [2047, 1023, 130, 0]
    pages = sum(-(-(p + 1) // ps) for p in prefix)
    pool = KVPool(1, pages, ps, hkv, hd, torch.bfloat16, "cpu")
    attn = create_attention_backend("torch", pool, hq, hkv, hd, hd**-0.5)
    assert isinstance(attn, TorchAttentionBackend) and attn.cpu_decode
    free = list(range(pages))
    random.Random(7).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(p + 1) // ps))] for p in prefix]
    g = torch.Generator().manual_seed(7)
    past = [torch.randn(2, p, hkv, hd, generator=g).bfloat16() for p in prefix]
    for (pk, pv), table, p in zip(past, tables, prefix, strict=True):
        slots = [table[i // ps] * ps + i % ps for i in range(p)]
        pool.k_buffers[0][slots], pool.v_buffers[0][slots] = pk, pv
    b = len(prefix)
    q = torch.randn(b, hq, hd, generator=g).bfloat16()
    k, v = (torch.randn(b, hkv, hd, generator=g).bfloat16() for _ in range(2))
    meta = attn.prepare(BatchLayout(ps, prefix, [1] * b, tables))
    assert [grp.decode_kernel for grp in meta.groups] == [True]  # type: ignore[attr-defined]
    out = attn.forward(q, k, v, 0, meta).float()
    for i, (pk, pv) in enumerate(past):
        full_k = torch.cat([pk, k[i : i + 1]]).double().repeat_interleave(hq // hkv, 1)
        full_v = torch.cat([pv, v[i : i + 1]]).double().repeat_interleave(hq // hkv, 1)
        probs = (torch.einsum("hd,khd->hk", q[i].double(), full_k) * hd**-0.5).softmax(-1)
        want = torch.einsum("hk,khd->hd", probs, full_v).reshape(-1).float()
        torch.testing.assert_close(out[i], want, atol=2e-2, rtol=2e-2)


def test_too_few_pages_is_an_error() -> None:
    pool = KVPool(1, 8, PAGE, 2, D, torch.float32, "cpu")
    attn = create_attention_backend("torch", pool, 4, 2, D, D**-0.5)
    with pytest.raises(ValueError, match="cannot hold"):
        attn.prepare(BatchLayout(PAGE, [3], [2], [[1]]))


def test_a_short_page_table_is_refused_by_every_backend_s_check() -> None:
    """The torch backend and flashinfer's plan (build_paged_plan, importable without
    flashinfer) refuse a short table through one shared check, before any device work."""
    short = BatchLayout(PAGE, [3, 6], [1, 3], [[5], [1, 2]])  # request 1: 9 tokens, 2 pages
    check_page_tables(BatchLayout(PAGE, [3, 6], [1, 2], [[5], [1, 2]]))  # exactly full: fine
    for check in (check_page_tables, build_paged_plan):
        with pytest.raises(ValueError, match="request 1: 2 pages of 4 cannot hold 9 tokens"):
            check(short)


def test_backend_names() -> None:
    assert resolve_backend_name("auto", "cpu", torch.float32) == "torch"
    pool = KVPool(1, 2, PAGE, 1, D, torch.float32, "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope", pool, 1, 1, D, 1.0)


def test_flashinfer_dtypes_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """flashinfer runs float16/bfloat16 only: auto serves float32 (dtype auto on a checkpoint
    that names none) with the torch backend; asking for flashinfer with it is refused."""
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())
    assert resolve_backend_name("auto", "cuda", torch.bfloat16) == "flashinfer"
    assert resolve_backend_name("auto", "cuda", torch.float16) == "flashinfer"
    assert resolve_backend_name("auto", "cuda", torch.float32) == "torch"
    assert resolve_backend_name("flashinfer", "cuda", torch.bfloat16) == "flashinfer"
    with pytest.raises(ValueError, match="runs float16 and bfloat16, not float32.*--dtype"):
        resolve_backend_name("flashinfer", "cuda", torch.float32)
    pool = KVPool(1, 2, PAGE, 1, D, torch.float32, "cpu")
    pool.device = torch.device("cuda")  # only the check runs: it refuses before any CUDA work
    with pytest.raises(ValueError, match="not float32"):
        create_attention_backend("flashinfer", pool, 1, 1, D, 1.0)


def test_pool_size_accounting() -> None:
    per_page = KVPool.bytes_per_page(28, 16, 8, 128, torch.bfloat16)
    assert per_page == 2 * 28 * 16 * 8 * 128 * 2
    pool = KVPool(2, 3, PAGE, 2, D, torch.bfloat16, "cpu")
    assert pool.k_buffers[1].shape == (3 * PAGE, 2, D) and pool.num_slots == 12


def test_short_extends_run_row_by_row_on_the_decode_kernel() -> None:
    """A short prompt's prefill (the first token of a chat turn) takes the decode kernel's path,
    one query row at a time, instead of a K/V gather and an SDPA call per layer; long extends,
    and short ones after a long cached prefix, stay with SDPA."""
    pool = KVPool(1, NUM_PAGES, PAGE, 2, D, torch.float32, "cpu")
    attn = create_attention_backend("torch", pool, 4, 2, D, D**-0.5)
    assert isinstance(attn, TorchAttentionBackend) and attn.cpu_decode

    def groups(prefix: list[int], extend: list[int]) -> list[bool]:
        free = iter(range(NUM_PAGES))
        tables = [[next(free) for _ in range(-(-(p + e) // PAGE))] for p, e in zip(prefix, extend)]
        meta = attn.prepare(BatchLayout(PAGE, prefix, extend, tables))
        flags = [g.decode_kernel for g in meta.groups]  # type: ignore[attr-defined]
        assert (attn.decode_chain_inputs(meta) is not None) == (flags == [True])
        return flags

    assert groups([0], [6]) == [True]
    # Decodes beside a short prompt: one group of rows in step order, which the kernel stores
    # itself (the shape the CPU decode chain runs), however many decodes and however long
    # their contexts; beside a long prompt, the decodes and the prompt apart.
    assert groups([5, 0], [1, 6]) == [True]
    assert groups([300, 0], [1, 6]) == [True]
    assert groups([5] * 20 + [0], [1] * 20 + [6]) == [True]
    assert groups([5] * 3 + [0], [1] * 3 + [70]) == [True, False]
    assert groups([0], [40]) == [True]  # 820 key reads
    assert groups([0], [70]) == [False]  # more rows than the decode chain takes
    assert groups([300], [8]) == [False]  # 8 rows would each read 300+ keys


@pytest.mark.parametrize(
    "prefix,spare", [([5, 0, 37, 16], 0), ([5, 0, 37, 16], 2), ([40], 0), ([15], 3)]
)
def test_a_decode_step_s_metadata_equals_the_general_path_s(
    monkeypatch: pytest.MonkeyPatch, prefix: list[int], spare: int
) -> None:
    """prepare's shortcut for one new token per request (CPU decode kernel) builds what the
    general grouping builds for such a step: the same slots, lengths and call shape; for
    one request or several, with page tables that end at the step's token or hold `spare`
    pages more (a request's pages reserved ahead)."""
    pool = KVPool(1, NUM_PAGES, PAGE, 2, D, torch.float32, "cpu")
    attn = create_attention_backend("torch", pool, 4, 2, D, D**-0.5)
    assert isinstance(attn, TorchAttentionBackend) and attn.cpu_decode
    free = iter(random.Random(0).sample(range(NUM_PAGES), NUM_PAGES))
    tables = [[next(free) for _ in range(-(-(p + 1) // PAGE) + spare)] for p in prefix]
    layout = BatchLayout(PAGE, prefix, [1] * len(prefix), tables)
    fast = attn.prepare(layout)
    monkeypatch.setattr(attn, "_decode_only", lambda extend: False)
    general = attn.prepare(layout)
    assert fast.num_tokens == general.num_tokens
    assert torch.equal(fast.out_loc, general.out_loc)
    (a,), (b,) = fast.groups, general.groups
    assert (a.out_rows, a.valid, b.out_rows, b.valid) == (None,) * 4
    assert torch.equal(a.lens, b.lens) and a.decode_kernel and b.decode_kernel
    (ca,), (cb,) = a.calls, b.calls
    assert ca.k_slots is not None and cb.k_slots is not None
    assert torch.equal(ca.k_slots, cb.k_slots)
    for field in ("q_rows", "start", "shape", "lo", "hi", "causal", "blocked", "masks", "tiles"):
        assert getattr(ca, field) == getattr(cb, field), field
