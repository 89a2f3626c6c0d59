"""A pure-torch stand-in for the two flashinfer 0.7.4 wrappers the flashinfer backend uses.

No GPU here, so the backend's use of flashinfer (plan() arguments, the NHD page layout, the
CUDA-graph decode wrapper's fixed buffers) is exercised against this module, installed as
`flashinfer` in sys.modules. It keeps the documented contract, including what matters for
graphs: a `use_cuda_graph=True` decode wrapper copies plan()'s inputs into the buffers it was
built with and run() reads those buffers, so a replay that re-runs the recorded calls sees
whatever was planned last. It checks what flashinfer checks (int32 indices, the fixed batch
size, the indices buffer's capacity, a uint8 workspace) and computes attention in float32.
"""

from __future__ import annotations

import importlib.machinery
import math
import types

import torch


def _attend(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    qo_indptr: list[int],
    kv_indptr: list[int],
    indices: list[int],
    last_page_len: list[int],
    sm_scale: float | None,
) -> torch.Tensor:
    """Causal paged attention; each request's queries are the last of its keys."""
    k_cache, v_cache = caches
    _, ps, hkv, d = k_cache.shape
    hq = q.shape[1]
    scale = sm_scale if sm_scale is not None else 1 / math.sqrt(d)
    out = torch.empty_like(q)
    for i in range(len(last_page_len)):
        pages = torch.tensor(indices[kv_indptr[i] : kv_indptr[i + 1]], dtype=torch.long)
        kv_len = (len(pages) - 1) * ps + last_page_len[i]
        k = k_cache[pages].reshape(-1, hkv, d)[:kv_len].float()
        v = v_cache[pages].reshape(-1, hkv, d)[:kv_len].float()
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        qs = q[qo_indptr[i] : qo_indptr[i + 1]].float()
        n = qs.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        visible = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        out[qo_indptr[i] : qo_indptr[i + 1]] = o.to(q.dtype)
    return out


def _host(t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int32, f"flashinfer wants int32 indices, got {t.dtype}"
    return t.cpu().tolist()


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert float_workspace_buffer.dtype == torch.uint8
        assert kv_layout == "NHD"
        self.plans = 0

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        *,
        causal: bool = False,
        sm_scale: float | None = None,
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: torch.dtype | None = None,
    ) -> None:
        assert causal and num_qo_heads % num_kv_heads == 0
        self.qo = _host(qo_indptr)
        self.kv = _host(paged_kv_indptr)
        self.indices = _host(paged_kv_indices)
        self.last = _host(paged_kv_last_page_len)
        assert len(self.qo) == len(self.kv) == len(self.last) + 1
        assert all(1 <= n <= page_size for n in self.last)
        self.sm_scale = sm_scale
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]):  # noqa: ANN201
        assert q.is_contiguous() and q.shape[0] == self.qo[-1]
        return _attend(q, paged_kv_cache, self.qo, self.kv, self.indices, self.last, self.sm_scale)


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
    ) -> None:
        assert float_workspace_buffer.dtype == torch.uint8
        assert kv_layout == "NHD"
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            for buf in (
                paged_kv_indptr_buffer,
                paged_kv_indices_buffer,
                paged_kv_last_page_len_buffer,
            ):
                if not torch.is_tensor(buf):
                    raise ValueError("the buffers are required in cudagraph mode")
            assert paged_kv_last_page_len_buffer is not None and paged_kv_indptr_buffer is not None
            self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self.fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self.indptr_buf = paged_kv_indptr_buffer
        self.indices_buf = paged_kv_indices_buffer
        self.last_buf = paged_kv_last_page_len_buffer
        self.sm_scale: float | None = None
        self.plans = 0

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        sm_scale: float | None = None,
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: torch.dtype | None = None,
    ) -> None:
        for t in (indptr, indices, last_page_len):
            _host(t)
        assert num_qo_heads % num_kv_heads == 0
        if self.use_cuda_graph:
            assert self.indptr_buf is not None and self.indices_buf is not None
            assert self.last_buf is not None
            if len(last_page_len) != self.fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self.indices_buf):
                raise ValueError("The size of indices should be less than or equal to the buffer")
            self.indptr_buf.copy_(indptr)
            self.last_buf.copy_(last_page_len)
            self.indices_buf[: len(indices)].copy_(indices)
        else:
            self.indptr_buf, self.indices_buf, self.last_buf = indptr, indices, last_page_len
        self.sm_scale = sm_scale
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]):  # noqa: ANN201
        assert self.indptr_buf is not None and self.indices_buf is not None
        assert self.last_buf is not None and q.is_contiguous()
        # What the kernels read: the buffers as they are now, not what plan() was handed.
        last = _host(self.last_buf)
        assert q.shape[0] == len(last)
        qo = list(range(len(last) + 1))
        return _attend(
            q,
            paged_kv_cache,
            qo,
            _host(self.indptr_buf),
            _host(self.indices_buf),
            last,
            self.sm_scale,
        )


def module() -> types.ModuleType:
    """The stand-in as a module, to put in sys.modules["flashinfer"]."""
    mod = types.ModuleType("flashinfer")
    # A spec, so importlib.util.find_spec("flashinfer") (backend "auto") finds it installed.
    mod.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    mod.__version__ = "0.7.4+standin"  # type: ignore[attr-defined]
    mod.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    return mod
