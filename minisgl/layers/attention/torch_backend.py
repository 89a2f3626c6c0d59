"""Paged attention in plain PyTorch (CPU and CUDA): gather, then scaled_dot_product_attention.

A step's requests are split into two groups:
- decode: one new token per request; queries [B, 1], keys padded to the longest context;
- extend: several new tokens per request. Padded per request this costs B * maxQ * maxK; packed
  as one varlen sequence with a block-diagonal causal mask it costs sumQ * sumK; one causal call
  per request costs about sum(Q * K) / 2 (SDPA skips the masked-out half) plus a fixed cost per
  call. `prepare` picks the cheapest: a prefill chunk of a dozen 300-token prompts is mostly
  padding and masked-out cells as a rectangle, so per-request calls win there; many short
  extends stay one batched call.
Keeping decodes apart means a long prefill never inflates the decodes' query padding.
All index and mask tensors are built once per step in `prepare` (numpy, O(requests) Python);
`forward` is a fixed handful of tensor ops per group (or one call per request of the extend
group when that layout was picked).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers import cpu_kernels
from minisgl.layers.attention.base import AttentionBackend, AttentionMetadata, BatchLayout


@dataclass
class _Piece:
    """One request of an extend group attended on its own."""

    start: int  # its first row among the step's tokens
    length: int  # its new tokens
    k_slots: torch.Tensor  # [K] pool slots of its keys (prefix + new)
    mask: torch.Tensor | None  # [1, 1, Q, K] (after a cached prefix); None: plain causal


@dataclass
class _Group:
    q_rows: torch.Tensor | None  # [G, Q] rows of the step's tokens (padding: row 0); None:
    # the step's rows 0..T-1 in order, unpadded (q is then a view, no gather)
    k_slots: torch.Tensor  # [G, K] pool slots of the keys (padding: slot 0)
    shape: tuple[int, int]  # (G, Q)
    mask: torch.Tensor | None  # [G, 1, Q, K] True = attend; None = attend to all keys
    is_causal: bool  # a single request without prefix: SDPA's own causal mask
    out_rows: torch.Tensor | None  # step rows of the valid queries; None: all of 0..T-1 in order
    valid: torch.Tensor | None  # flat [G * Q] indices of the valid queries; None: all valid
    lens: torch.Tensor  # [G] keys per request (prefix + extend)
    pieces: list[_Piece] | None = None  # set: one SDPA call per request instead


@dataclass
class TorchMetadata(AttentionMetadata):
    num_tokens: int
    out_loc: torch.Tensor  # [T] pool slot of each new token
    groups: list[_Group]


# The fixed cost of one more SDPA call, in query x key cells (gather, launch, concatenation).
_CALL_CELLS = 1024


def _slots(pages: np.ndarray, req: np.ndarray, pos: np.ndarray, page_size: int) -> np.ndarray:
    return pages[req, pos // page_size] * page_size + pos % page_size


class TorchAttentionBackend(AttentionBackend):
    def __init__(
        self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim, scale)
        # On CPU, single-query groups go to a small C kernel when it is available (torch's CPU
        # SDPA costs ~0.5 ms per call for one query); the PyTorch path below is the fallback.
        self.cpu_decode = kv_pool.num_layers > 0 and cpu_kernels.supports_decode_attention(
            kv_pool.k_buffers[0], num_heads
        )

    def prepare(self, layout: BatchLayout) -> TorchMetadata:
        ps = layout.page_size
        prefix = np.asarray(layout.prefix_lens, dtype=np.int64)
        extend = np.asarray(layout.extend_lens, dtype=np.int64)
        total = prefix + extend
        n = len(extend)
        pages = np.zeros((n, max(len(p) for p in layout.page_tables)), dtype=np.int64)
        for i, table in enumerate(layout.page_tables):
            if len(table) * ps < total[i]:
                raise ValueError(
                    f"request {i}: {len(table)} pages of {ps} cannot hold {total[i]} tokens"
                )
            pages[i, : len(table)] = table
        starts = np.cumsum(extend) - extend  # first step row of each request
        req = np.repeat(np.arange(n), extend)
        pos = np.arange(int(extend.sum())) - starts[req] + prefix[req]
        out_loc = _slots(pages, req, pos, ps)

        decode = np.flatnonzero(extend == 1)
        ext = np.flatnonzero(extend > 1)
        groups = []
        for members in (decode, ext):
            if len(members):
                groups.append(self._group(members, prefix, extend, starts, pages, ps, n))
        return TorchMetadata(num_tokens=len(out_loc), out_loc=self._dev(out_loc), groups=groups)

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _group(
        self,
        members: np.ndarray,
        prefix: np.ndarray,
        extend: np.ndarray,
        starts: np.ndarray,
        pages: np.ndarray,
        ps: int,
        num_requests: int,
    ) -> _Group:
        pre, ext, st = prefix[members], extend[members], starts[members]
        tot = pre + ext
        g = len(members)
        packed_cells = int(ext.sum()) * int(tot.sum())
        padded_cells = g * int(ext.max()) * int(tot.max())
        each_cells = int((ext * tot).sum()) // 2 + _CALL_CELLS * g
        if ext.max() > 1 and g > 1 and each_cells < min(packed_cells, padded_cells):
            return self._group_each(members, pre, ext, st, pages, ps, num_requests)
        packed = ext.max() > 1 and g > 1 and packed_cells < padded_cells
        if packed:
            # One varlen row: queries and keys of all members concatenated; a key is visible to
            # a query of the same request at an earlier or equal position.
            q_req = np.repeat(np.arange(g), ext)
            q_pos = np.arange(int(ext.sum())) - np.repeat(np.cumsum(ext) - ext, ext) + pre[q_req]
            q_rows = (st[q_req] + q_pos - pre[q_req])[None]
            k_req = np.repeat(np.arange(g), tot)
            k_pos = np.arange(int(tot.sum())) - np.repeat(np.cumsum(tot) - tot, tot)
            k_slots = _slots(pages, members[k_req], k_pos, ps)[None]
            mask = (q_req[:, None] == k_req[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            mask_t: torch.Tensor | None = self._dev(mask[None, None])
            valid = None
            rows_flat = q_rows[0]
        else:
            qn, kn = int(ext.max()), int(tot.max())
            j = np.arange(qn)[None, :]
            q_ok = j < ext[:, None]  # [g, Q]
            q_rows = np.where(q_ok, st[:, None] + j, 0)
            kp = np.arange(kn)[None, :]
            k_ok = kp < tot[:, None]
            k_slots = np.where(
                k_ok, _slots(pages, members[:, None], np.minimum(kp, tot[:, None] - 1), ps), 0
            )
            q_pos = pre[:, None] + j  # [g, Q]
            mask = k_ok[:, None, :] & (kp[:, None, :] <= q_pos[:, :, None])
            mask |= ~q_ok[:, :, None]  # padded queries see everything (no NaN rows)
            need_mask = not bool(mask.all())
            mask_t = self._dev(mask[:, None]) if need_mask else None
            valid_idx = np.flatnonzero(q_ok.reshape(-1))
            valid = None if len(valid_idx) == q_ok.size else self._dev(valid_idx)
            rows_flat = q_rows.reshape(-1)[valid_idx]
        is_causal = False
        if g == 1 and pre[0] == 0 and ext[0] > 1:
            mask_t, is_causal = None, True
        identity = g == num_requests and np.array_equal(rows_flat, np.arange(len(rows_flat)))
        in_order = valid is None and np.array_equal(q_rows.reshape(-1), np.arange(q_rows.size))
        return _Group(
            q_rows=None if in_order and identity else self._dev(q_rows),
            shape=(int(q_rows.shape[0]), int(q_rows.shape[1])),
            k_slots=self._dev(k_slots),
            mask=mask_t,
            is_causal=is_causal,
            out_rows=None if identity else self._dev(rows_flat),
            valid=valid,
            lens=self._dev(tot),
        )

    def _group_each(
        self,
        members: np.ndarray,
        pre: np.ndarray,
        ext: np.ndarray,
        st: np.ndarray,
        pages: np.ndarray,
        ps: int,
        num_requests: int,
    ) -> _Group:
        pieces = []
        for i, req in enumerate(members):
            k_pos = np.arange(int(pre[i] + ext[i]))
            mask = None
            if pre[i] > 0:  # causal, shifted by the cached prefix
                q_pos = pre[i] + np.arange(int(ext[i]))
                mask = self._dev((k_pos[None, :] <= q_pos[:, None])[None, None])
            slots = self._dev(_slots(pages, np.full_like(k_pos, req), k_pos, ps))
            pieces.append(_Piece(int(st[i]), int(ext[i]), slots, mask))
        rows = np.concatenate([np.arange(s, s + e) for s, e in zip(st, ext)])
        identity = len(members) == num_requests and np.array_equal(rows, np.arange(len(rows)))
        return _Group(
            q_rows=None,
            k_slots=self._dev(np.zeros(0, dtype=np.int64)),
            shape=(1, len(rows)),
            mask=None,
            is_causal=False,
            out_rows=None if identity else self._dev(rows),
            valid=None,
            lens=self._dev(pre + ext),
            pieces=pieces,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, TorchMetadata)
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        # A plain decode step on CPU: the kernel stores the new rows itself.
        new = (k, v, meta.out_loc) if self._decode_in_place(meta, k_buf, k, v) else None
        if new is None:
            k_buf.index_copy_(0, meta.out_loc, k)
            v_buf.index_copy_(0, meta.out_loc, v)
        width = self.num_heads * self.head_dim
        out: torch.Tensor | None = None
        for grp in meta.groups:
            o = self._attend(q, k_buf, v_buf, grp, new)  # [G * Q, Hq * D]
            if grp.valid is not None:
                o = o[grp.valid]
            if grp.out_rows is None:
                return o
            if out is None:
                out = q.new_empty(meta.num_tokens, width)
            out[grp.out_rows] = o
        assert out is not None
        return out

    def _decode_in_place(
        self, meta: TorchMetadata, k_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        """Whether this step is one query per request, every row in order, for the CPU kernel
        with rows it can store itself."""
        if not self.cpu_decode or len(meta.groups) != 1:
            return False
        grp = meta.groups[0]
        return (
            grp.pieces is None
            and grp.shape[1] == 1
            and grp.q_rows is None
            and grp.out_rows is None
            and grp.valid is None
            and cpu_kernels.can_write_new(k_buf, k, v)
        )

    def _attend(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        grp: _Group,
        new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`new`: the step's rows for the CPU decode kernel to store (see _decode_in_place)."""
        if grp.pieces is not None:
            return torch.cat([self._attend_one(q, k_buf, v_buf, p) for p in grp.pieces])
        g, qn = grp.shape
        if qn == 1 and self.cpu_decode:
            qd = q if grp.q_rows is None else q[grp.q_rows[:, 0]]
            return cpu_kernels.decode_attention(
                qd, k_buf, v_buf, grp.k_slots, grp.lens, self.scale, new
            )
        if grp.q_rows is None:
            qg = q.view(g, qn, self.num_heads, self.head_dim).transpose(1, 2)  # [G, Hq, Q, D]
        else:
            qg = q[grp.q_rows].transpose(1, 2)
        flat = grp.k_slots.view(-1)
        kg = k_buf.index_select(0, flat).view(g, -1, self.num_kv_heads, self.head_dim)
        vg = v_buf.index_select(0, flat).view(g, -1, self.num_kv_heads, self.head_dim)
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)  # [G, Hkv, K, D]
        o = F.scaled_dot_product_attention(
            qg,
            kg,
            vg,
            attn_mask=grp.mask,
            is_causal=grp.is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.transpose(1, 2).reshape(g * qn, self.num_heads * self.head_dim)

    def _attend_one(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, p: _Piece
    ) -> torch.Tensor:
        qg = q[p.start : p.start + p.length].transpose(0, 1)[None]  # [1, Hq, Q, D]
        kg = k_buf.index_select(0, p.k_slots).transpose(0, 1)[None]  # [1, Hkv, K, D]
        vg = v_buf.index_select(0, p.k_slots).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            qg,
            kg,
            vg,
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o[0].transpose(0, 1).reshape(p.length, self.num_heads * self.head_dim)
