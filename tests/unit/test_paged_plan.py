"""FlashInfer's plan() gets its index arrays as host tensors built from the scheduler's lists:
handed device tensors, it copies each back to the host and so waits on the GPU, every step."""

from __future__ import annotations

import pytest
import torch

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers.attention.base import AttentionBackend, BatchLayout
from minisgl.layers.attention.flashinfer_backend import FlashInferAttentionBackend
from minisgl.layers.attention.paged_plan import build_paged_plan

PAGE = 4
# A long prefill, a decode at a page boundary, a chunk after a cached prefix, a first token.
LAYOUT = BatchLayout(
    PAGE,
    prefix_lens=[0, 8, 5, 0],
    extend_lens=[9, 1, 6, 1],
    page_tables=[[7, 3, 11], [2, 9, 4, 40], [5, 6, 8], [1]],
)


def naive(layout: BatchLayout) -> dict[str, list[int]]:
    """plan()'s arguments written out request by request."""
    qo, kv, indices, last, slots = [0], [0], [], [], []
    for p, e, table in zip(layout.prefix_lens, layout.extend_lens, layout.page_tables):
        n = -(-(p + e) // PAGE)
        qo.append(qo[-1] + e)
        kv.append(kv[-1] + n)
        indices += table[:n]
        last.append(p + e - (n - 1) * PAGE)
        slots += [table[t // PAGE] * PAGE + t % PAGE for t in range(p, p + e)]
    return {"qo": qo, "kv": kv, "indices": indices, "last": last, "slots": slots}


def test_plan_inputs_are_int32_host_tensors_from_the_lists() -> None:
    plan = build_paged_plan(LAYOUT)
    want = naive(LAYOUT)
    got = [plan.qo_indptr, plan.kv_indptr, plan.indices, plan.last_page_len]
    for t, key in zip(got, ["qo", "kv", "indices", "last"]):
        assert t.device.type == "cpu" and t.dtype == torch.int32 and t.is_contiguous()
        assert t.tolist() == want[key], key
    assert plan.out_loc.tolist() == want["slots"]


def test_a_page_table_too_short_is_refused() -> None:
    short = BatchLayout(PAGE, [4], [5], [[3, 1]])  # 9 tokens need 3 pages
    with pytest.raises(ValueError, match="request 0: 2 pages of 4 cannot hold 9 tokens"):
        build_paged_plan(short)


class _Recorder:
    """flashinfer's prefill wrapper, reduced to remembering what plan() was handed."""

    def plan(self, *args: object, **kwargs: object) -> None:
        self.planned = [a for a in args if isinstance(a, torch.Tensor)]


def test_the_backend_hands_plan_host_tensors() -> None:
    # The "meta" device stands for the GPU: a tensor moved there is no longer on the host.
    pool = KVPool(1, 48, PAGE, 2, 8, torch.float16, "meta")
    backend = FlashInferAttentionBackend.__new__(FlashInferAttentionBackend)
    AttentionBackend.__init__(backend, pool, 4, 2, 8, 8**-0.5)  # no flashinfer to import here
    backend.wrapper = recorder = _Recorder()
    meta = backend.prepare(LAYOUT)
    want = naive(LAYOUT)
    assert [t.device.type for t in recorder.planned] == ["cpu"] * 4
    assert [t.tolist() for t in recorder.planned] == [
        want["qo"],
        want["kv"],
        want["indices"],
        want["last"],
    ]
    assert meta.out_loc.device.type == "meta" and meta.out_loc.shape == (17,)
