"""Attention over a paged pool in tiles, so no call holds chunk x keys x heads of anything.

A call is G rows of Q queries against K key slots each; query (g, i) sees the keys lo[g, i] ..
hi[g, i] of its row (inclusive). That covers every layout of the torch backend: causal after a
cached prefix (lo = 0, hi = position), requests of different lengths padded to a rectangle
(keys past a request's end lie past every hi), requests packed into one row (lo = the request's
first key). Masks are never stored: each tile compares key indices with lo/hi when it runs.

`plan_tiles` (host, numpy) splits the queries into tiles and each tile's keys into blocks,
drops blocks no query of the tile sees and marks the blocks every query sees whole (no mask).
`attend_blocked` runs a plan in plain PyTorch with an online softmax (flash-attention's running
max and sum, in float32): queries are grouped per KV head ([G, Hkv, group x Tq, D] against
[G, Hkv, B, D]) so K/V are never repeated per query head, and the largest temporaries are one
tile's scores, [G, Hq, Tq, B] floats. It is the path where no fused kernel serves a masked call
(on CUDA, SDPA with a mask and GQA falls to its math kernel, which repeats K/V per query head
and holds every score); on CPU the backend gives SDPA's flash kernel one query tile at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl.kvcache.kv_pool import gather


@dataclass
class Tile:
    q0: int  # query columns [q0, q1) of every row
    q1: int
    blocks: list[tuple[int, int, bool]]  # key ranges [k0, k1) and whether a mask is needed


def plan_tiles(lo: np.ndarray, hi: np.ndarray, q_tile: int, k_block: int) -> list[Tile]:
    """lo/hi [G, Q] -> tiles of `q_tile` query columns, each with the key blocks (at most
    `k_block` keys) that some of its queries see."""
    tiles = []
    num_q = lo.shape[1]
    for q0 in range(0, num_q, q_tile):
        q1 = min(q0 + q_tile, num_q)
        tlo, thi = lo[:, q0:q1].reshape(-1), hi[:, q0:q1].reshape(-1)
        k_lo, k_hi = int(tlo.min()), int(thi.max()) + 1
        starts = np.arange(k_lo, k_hi, k_block)
        ends = np.minimum(starts + k_block, k_hi)
        # [blocks, rows]: which queries see some of a block, which see all of it.
        some = (tlo[None, :] < ends[:, None]) & (thi[None, :] >= starts[:, None])
        every = (tlo[None, :] <= starts[:, None]) & (thi[None, :] >= ends[:, None] - 1)
        seen, whole = np.any(some, axis=1), np.all(every, axis=1)
        blocks = [(int(starts[b]), int(ends[b]), not bool(whole[b])) for b in np.flatnonzero(seen)]
        tiles.append(Tile(q0, q1, blocks))
    return tiles


def tile_shape(rows: int, num_q: int, num_k: int, cells: int, max_q_tile: int) -> tuple[int, int]:
    """(query columns, keys) per tile for `rows` (G x query heads) so that one tile's scores
    hold about `cells` values: up to `max_q_tile` columns, then as many keys as fit (>= 16)."""
    q_tile = max(1, min(num_q, max_q_tile))
    k_block = max(16, min(num_k, cells // (rows * q_tile)))
    q_tile = max(1, min(q_tile, cells // (rows * k_block)))
    return q_tile, k_block


def hidden_keys(lo: torch.Tensor, hi: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    """[G, Tq, k1 - k0] True where query (g, i) does not see key k0 + j (lo/hi [G, Tq])."""
    j = torch.arange(k0, k1, device=lo.device)
    return (j < lo[..., None]) | (j > hi[..., None])


def attend_blocked(
    qg: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k_slots: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    tiles: list[Tile],
    scale: float,
) -> torch.Tensor:
    """qg [G, Q, Hq, D]; k/v_buf [slots, Hkv, D] (any float dtype: an fp8 cache's rows are
    widened as they are read); k_slots [G, K]; lo/hi [G, Q] -> [G, Q, Hq * D] in qg's dtype."""
    g, num_q, hq, d = qg.shape
    hkv = k_buf.shape[1]
    grp = hq // hkv
    out = qg.new_empty(g, num_q, hq * d)
    for t in tiles:
        tq = t.q1 - t.q0
        rows = grp * tq
        # [G, Tq, Hkv, grp, D] -> [G, Hkv, grp * Tq, D]: a KV head's queries side by side.
        qt = qg[:, t.q0 : t.q1].reshape(g, tq, hkv, grp, d).permute(0, 2, 3, 1, 4)
        qt = qt.reshape(g * hkv, rows, d).float() * scale
        m = qt.new_full((g * hkv, rows, 1), float("-inf"))
        total = qt.new_zeros(g * hkv, rows, 1)
        acc = qt.new_zeros(g * hkv, rows, d)
        tlo, thi = lo[:, t.q0 : t.q1], hi[:, t.q0 : t.q1]
        for k0, k1, masked in t.blocks:
            b = k1 - k0
            slots = k_slots[:, k0:k1].reshape(-1)
            kb = gather(k_buf, slots).float().view(g, b, hkv, d).permute(0, 2, 3, 1)
            vb = gather(v_buf, slots).float().view(g, b, hkv, d).permute(0, 2, 1, 3)
            s = torch.bmm(qt, kb.reshape(g * hkv, d, b).float())  # [G * Hkv, rows, B]
            if masked:
                hide = hidden_keys(tlo, thi, k0, k1)[:, None, None]  # [G, 1, 1, Tq, B]
                s.view(g, hkv, grp, tq, b).masked_fill_(hide, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            # A row that has seen no key yet keeps -inf: subtract 0 there (exp gives 0s).
            m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)
            s.sub_(m_use).exp_()
            keep = (m - m_use).exp_()
            total.mul_(keep).add_(s.sum(-1, keepdim=True))
            acc.mul_(keep).baddbmm_(s, vb.reshape(g * hkv, b, d).float())
            m = m_new
        o = (acc / total).view(g, hkv, grp, tq, d).permute(0, 3, 1, 2, 4)  # [G, Tq, Hkv, grp, D]
        out[:, t.q0 : t.q1] = o.reshape(g, tq, hq * d)
    return out
