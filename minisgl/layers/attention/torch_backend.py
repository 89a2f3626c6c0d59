"""Paged attention in plain PyTorch (CPU and CUDA): gather, then attend.

A step's requests are split into two groups:
- decode: one new token per request; queries [B, 1], keys padded to the longest context;
- extend: several new tokens per request. Padded per request this costs B * maxQ * maxK; packed
  as one varlen sequence with a block-diagonal causal mask it costs sumQ * sumK; one causal call
  per request costs about sum(Q * K) / 2 (SDPA skips the masked-out half) plus a fixed cost per
  call. `prepare` picks the cheapest: a prefill chunk of a dozen 300-token prompts is mostly
  padding and masked-out cells as a rectangle, so per-request calls win there; many short
  extends stay one batched call.
Keeping decodes apart means a long prefill never inflates the decodes' query padding.
On a CPU with AMX-BF16 or AVX512-BF16 (bf16, head dims 64/128) the extend group is one call
of our prefill kernel (cpu_prefill.py), which reads the new tokens' q/k/v as the step holds
them and only a cached prefix from the pool, and writes the rows of the step's output in
place; the calls below are then built only if it refuses the tensors. Elsewhere a fresh prompt (no cached
prefix) attends over the step's own K/V rows, views of the qkv projection, not over its rows
gathered back from the pool (in a prefill chunk of 128-token prompts the gather was ~10% of
the attention time), and fresh prompts of one length lying next to each other in the step (a
burst of equal prompts) share one causal SDPA call.

Each call says which keys each query sees as an interval of key indices (tiles.py); masks are
built per tile when it runs, never for the whole chunk x keys. Calls without a mask (one
request's causal prefill, decodes of equal length) go to SDPA, whose fused kernels take them
without materialising scores (CPU: its flash kernel; CUDA: flash in half precision). Masked
calls go to SDPA one query tile at a time on CPU (the flash kernel reads the mask, holding only
the tile's) and to `attend_blocked` elsewhere (CUDA's SDPA would fall to its math kernel with a
mask and GQA, which repeats K/V per query head and holds every score).
All index tensors and tile plans are built once per step in `prepare` (numpy, O(requests)
Python plus O(tiles)); `forward` is a fixed handful of tensor ops per tile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers import cpu_kernels
from minisgl.layers.attention import cpu_prefill
from minisgl.layers.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
    check_page_tables,
)
from minisgl.layers.attention.tiles import Tile, attend_blocked, hidden_keys, plan_tiles, tile_shape


@dataclass
class _Call:
    """G rows of Q queries against K keys each; query (g, i) sees keys lo[g, i] .. hi[g, i]."""

    q_rows: torch.Tensor | None  # [G, Q] rows of the step's tokens (padding: row 0); None:
    # the step's rows start .. start + G * Q in order (q is then a view, no gather)
    start: int
    shape: tuple[int, int]  # (G, Q)
    # [G, K] pool slots of the keys (padding: slot 0); None: the keys are the step's own rows
    # start .. start + G * Q (G fresh prompts of Q tokens, causal: K = Q)
    k_slots: torch.Tensor | None
    lo: torch.Tensor | None  # [G, Q] first key each query sees (None without tiles)
    hi: torch.Tensor | None  # [G, Q] last key each query sees
    causal: bool  # one request without prefix: SDPA's own causal mask serves it
    blocked: bool  # attend_blocked runs the tiles; else SDPA, once per tile (one key block)
    # SDPA tiles' masks [G, 1, Tq, K], built once for every layer when all of them are small;
    # None: each layer builds each tile's mask as it runs
    masks: list[torch.Tensor | None] | None
    tiles: list[Tile]  # SDPA with none: one call without a mask (causal, or every key seen)


@dataclass
class _Group:
    calls: list[_Call]  # one (padded or packed), or one per request (outputs concatenated)
    out_rows: torch.Tensor | None  # step rows of the valid queries; None: all of 0..T-1 in order
    valid: torch.Tensor | None  # flat [G * Q] indices of the valid queries; None: all valid
    lens: torch.Tensor  # [G] keys per request (prefix + extend)
    # One query row per kernel row, for the CPU decode kernel (which may store the step's new
    # rows itself: it writes them all before any row attends, so a short extend's rows, which
    # read each other's keys, may too)
    decode_kernel: bool
    # The CPU prefill kernel's plan for these prompts (cpu_prefill.py; it writes their rows of the
    # step's output in place); `calls` are then built only if it cannot run (`fallback`).
    prefill_plan: cpu_prefill.Plan | None = None
    fallback: Callable[[], _Group] | None = None


@dataclass
class TorchMetadata(AttentionMetadata):
    num_tokens: int
    out_loc: torch.Tensor  # [T] pool slot of each new token
    groups: list[_Group]


# The fixed cost of one more SDPA call, in query x key cells (gather, launch, concatenation).
_CALL_CELLS = 1024
# A short extend (a chat turn's few new tokens, a short prompt's prefill) goes to the CPU decode
# kernel one query row at a time, each row over its request's keys up to its own position: for
# a 6-token prompt ~25 us a layer against ~90 us for the K/V gather and SDPA call (one thread,
# Qwen3-0.6B heads), so a short prompt's prefill costs what a decode step does apart from the
# matmuls. Bounded in query rows and in key rows read (the rows do not share their loads). Up to
# the decode chain's 64 rows (cpu_chain.MAX_ROWS), which then runs the whole step in one C
# call: a 40-token prompt's prefill 1.06x faster than through the prefill kernel layer by layer,
# three 20-token prompts 1.02-1.07x (Qwen3-0.6B shape, bf16, 2-core AMD EPYC Zen 4).
_ROWS_MAX_QUERIES = 64
_ROWS_MAX_KEY_READS = 2048


@functools.lru_cache(maxsize=8)
def _offsets(n: int) -> np.ndarray:
    """0 .. n - 1 (int64) for a page size, made once: read-only, shared by the steps."""
    a = np.arange(n, dtype=np.int64)
    a.flags.writeable = False
    return a


def _slots(pages: np.ndarray, req: np.ndarray, pos: np.ndarray, page_size: int) -> np.ndarray:
    return pages[req, pos // page_size] * page_size + pos % page_size


class TorchAttentionBackend(AttentionBackend):
    # Masked SDPA calls (CPU) hold one query tile's mask ([G, 1, Tq, keys] bool, then in q's
    # dtype): Tq = this many cells over the keys, but no fewer rows than sdpa_q_tile_min
    # (torch's CPU flash kernel splits queries by 256 from 768 rows on, its fastest; at 32k keys
    # 768 rows of mask are ~100 MiB, less than the call's gathered K/V of a Qwen3-8B layer).
    sdpa_mask_cells = 1 << 22
    sdpa_q_tile_min = 768
    # attend_blocked: one tile's scores (G x query heads x Tq x keys, float32), and its
    # query columns.
    tile_cells = 1 << 24
    q_tile = 512

    def __init__(
        self, kv_pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__(kv_pool, num_heads, num_kv_heads, head_dim, scale)
        # On CPU, single-query groups go to a small C kernel when it is available (torch's CPU
        # SDPA costs ~0.5 ms per call for one query); the PyTorch path below is the fallback.
        self.cpu_decode = kv_pool.num_layers > 0 and cpu_kernels.supports_decode_attention(
            kv_pool.k_buffers[0], num_heads
        )
        cpu = self.device.type == "cpu"
        # Which calls SDPA serves with bounded memory: on CPU all (its flash kernel takes a mask
        # and GQA); on CUDA only those without a mask, in half precision (its flash kernel).
        self.sdpa_masked = cpu
        self.sdpa_plain = cpu or kv_pool.dtype in (torch.float16, torch.bfloat16)
        # Prefills (fresh or after a cached prefix) on the C kernel where the CPU has AMX-BF16 or
        # AVX512-BF16 (bf16).
        self.cpu_prefill = cpu and cpu_prefill.available(
            kv_pool.dtype, head_dim, num_heads, num_kv_heads
        )

    def prepare(self, layout: BatchLayout) -> TorchMetadata:
        ps = layout.page_size
        check_page_tables(layout)
        if self._decode_only(layout.extend_lens):
            return self._prepare_decode(layout.prefix_lens, layout.page_tables, ps)
        prefix = np.asarray(layout.prefix_lens, dtype=np.int64)
        extend = np.asarray(layout.extend_lens, dtype=np.int64)
        n = len(extend)
        pages = np.zeros((n, max(len(p) for p in layout.page_tables)), dtype=np.int64)
        for i, table in enumerate(layout.page_tables):
            pages[i, : len(table)] = table
        starts = np.cumsum(extend) - extend  # first step row of each request
        req = np.repeat(np.arange(n), extend)
        pos = np.arange(int(extend.sum())) - starts[req] + prefix[req]
        out_loc = _slots(pages, req, pos, ps)

        decode = np.flatnonzero(extend == 1)
        ext = np.flatnonzero(extend > 1)
        if self._all_rows(prefix, extend, ext):
            group = self._group_rows(req, pos, pages, ps)
            return TorchMetadata(
                num_tokens=len(out_loc), out_loc=self._dev(out_loc), groups=[group]
            )
        groups = []
        for members in (decode, ext):
            if len(members):
                groups.append(self._group(members, prefix, extend, starts, pages, ps, n))
        return TorchMetadata(num_tokens=len(out_loc), out_loc=self._dev(out_loc), groups=groups)

    def _decode_only(self, extend: Sequence[int]) -> bool:
        return self.cpu_decode and len(extend) > 0 and max(extend) == 1

    def _prepare_decode(
        self, prefix_lens: list[int], tables: list[list[int]], ps: int
    ) -> TorchMetadata:
        """`prepare` for a step of one new token per request on the CPU decode kernel: the
        metadata _group_calls makes for it (one padded call, rows in order, no tiles), without
        the general path's numpy passes. From the layout's lists: a B=1 step's few array ops
        run on caches the step's weight stream has emptied, ~10 us each (1 thread, AMD EPYC
        Zen 4), so each one saved counts."""
        n = len(prefix_lens)
        kmax = max(prefix_lens) + 1
        # Every slot of the pages the longest request spans, in order, cut at its length: key
        # j of request i is slot j of the row (pages past a shorter request's own are padding,
        # zeroed below).
        used = -(-kmax // ps)
        rows = [t[:used] if len(t) >= used else t + [0] * (used - len(t)) for t in tables]
        pages = np.array(rows, dtype=np.int64)
        slots = (pages[:, :, None] * ps + _offsets(ps)).reshape(n, used * ps)
        tot = np.array(prefix_lens, dtype=np.int64) + 1
        if n == 1:  # one request: its own keys only, nothing to pad
            k_slots = slots[:, :kmax]
            out_loc = slots[0, prefix_lens[0] : kmax]
        else:
            k_slots = np.where(np.arange(kmax)[None, :] < tot[:, None], slots[:, :kmax], 0)
            out_loc = slots[np.arange(n), tot - 1]
        call = _Call(
            q_rows=None,
            start=0,
            shape=(n, 1),
            k_slots=self._dev(k_slots),
            lo=None,
            hi=None,
            causal=False,
            blocked=False,
            masks=None,
            tiles=[],
        )
        group = _Group(
            calls=[call], out_rows=None, valid=None, lens=self._dev(tot), decode_kernel=True
        )
        return TorchMetadata(num_tokens=n, out_loc=self._dev(out_loc), groups=[group])

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if self.device.type == "cpu" else t.to(self.device)

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
        if ext.max() > 1 and self.cpu_prefill and int(tot.max()) <= cpu_prefill.MAX_LEN:
            return _Group(
                calls=[],
                out_rows=None,
                valid=None,
                lens=self._dev(tot),
                decode_kernel=False,
                prefill_plan=self._prefill_plan(members, pre, ext, st, pages, ps),
                fallback=lambda: self._group_calls(members, pre, ext, st, pages, ps, num_requests),
            )
        return self._group_calls(members, pre, ext, st, pages, ps, num_requests)

    def _prefill_plan(
        self,
        members: np.ndarray,
        pre: np.ndarray,
        ext: np.ndarray,
        st: np.ndarray,
        pages: np.ndarray,
        ps: int,
    ) -> cpu_prefill.Plan:
        """Every member's step rows (its output rows too) and length, and where it has a
        cached prefix, that prefix's pool slots (its new tokens' keys are the step's rows)."""
        rows = self._dev(np.stack([st, st, ext]))
        if not pre.any():
            return cpu_prefill.Plan(rows, None, None)
        req = np.repeat(members, pre)
        pos = np.arange(int(pre.sum())) - np.repeat(np.cumsum(pre) - pre, pre)
        slots = _slots(pages, req, pos, ps)
        return cpu_prefill.Plan(
            rows, self._dev(np.stack([pre, np.cumsum(pre) - pre])), self._dev(slots)
        )

    def _group_calls(
        self,
        members: np.ndarray,
        pre: np.ndarray,
        ext: np.ndarray,
        st: np.ndarray,
        pages: np.ndarray,
        ps: int,
        num_requests: int,
    ) -> _Group:
        """The group as SDPA calls (or attend_blocked tiles): per request, padded or packed,
        whichever costs least."""
        tot = pre + ext
        g = len(members)
        packed_cells = int(ext.sum()) * int(tot.sum())
        padded_cells = g * int(ext.max()) * int(tot.max())
        runs = self._runs(pre, ext, st)
        each_cells = int((ext * tot).sum()) // 2 + _CALL_CELLS * len(runs)
        # One request: its own call only saves work when it needs no gather (fresh).
        several = g > 1 or runs[0][2]
        if ext.max() > 1 and several and each_cells < min(packed_cells, padded_cells):
            return self._group_each(members, pre, ext, st, pages, ps, num_requests, runs)
        packed = ext.max() > 1 and g > 1 and packed_cells < padded_cells
        if packed:
            # One varlen row: queries and keys of all members concatenated; a query sees the
            # keys of its own request up to its position.
            q_req = np.repeat(np.arange(g), ext)
            q_pos = np.arange(int(ext.sum())) - np.repeat(np.cumsum(ext) - ext, ext) + pre[q_req]
            q_rows = (st[q_req] + q_pos - pre[q_req])[None]
            k_req = np.repeat(np.arange(g), tot)
            k_pos = np.arange(int(tot.sum())) - np.repeat(np.cumsum(tot) - tot, tot)
            k_slots = _slots(pages, members[k_req], k_pos, ps)[None]
            k_first = np.cumsum(tot) - tot
            lo, hi = k_first[q_req][None], (k_first[q_req] + q_pos)[None]
            valid = None
            rows_flat = q_rows[0]
        else:
            qn, kn = int(ext.max()), int(tot.max())
            j = np.arange(qn)[None, :]
            q_ok = j < ext[:, None]  # [g, Q]
            q_rows = np.where(q_ok, st[:, None] + j, 0)
            kp = np.arange(kn)[None, :]
            k_slots = _slots(pages, members[:, None], np.minimum(kp, tot[:, None] - 1), ps)
            k_slots = np.where(kp < tot[:, None], k_slots, 0)
            # Padded queries see all of their request's keys (no empty rows); padded keys lie
            # past every query's last key.
            lo = np.zeros_like(q_rows)
            hi = np.where(q_ok, pre[:, None] + j, tot[:, None] - 1)
            valid_idx = np.flatnonzero(q_ok.reshape(-1))
            valid = None if len(valid_idx) == q_ok.size else self._dev(valid_idx)
            rows_flat = q_rows.reshape(-1)[valid_idx]
        decode_kernel = q_rows.shape[1] == 1 and self.cpu_decode
        causal = bool(g == 1 and pre[0] == 0 and ext[0] > 1)
        identity = g == num_requests and np.array_equal(rows_flat, np.arange(len(rows_flat)))
        in_order = valid is None and np.array_equal(q_rows.reshape(-1), np.arange(q_rows.size))
        q_rows_t = None if in_order and identity else self._dev(q_rows)
        call = self._call(q_rows_t, 0, k_slots, lo, hi, causal, plan=not decode_kernel)
        return _Group(
            calls=[call],
            out_rows=None if identity else self._dev(rows_flat),
            valid=valid,
            lens=self._dev(tot),
            decode_kernel=decode_kernel,
        )

    def _all_rows(self, prefix: np.ndarray, extend: np.ndarray, ext: np.ndarray) -> bool:
        """Whether the whole step (its short extends and any decodes beside them) is one group
        of decode-kernel rows in step order: one kernel call a layer, and the shape the CPU
        decode chain runs (decode_chain_inputs), so a short prompt's prefill and a step that
        mixes one with decodes are one C call for all layers, not ~10 calls a layer from
        Python."""
        return self.cpu_decode and len(ext) > 0 and self._short_extend(prefix[ext], extend[ext])

    @staticmethod
    def _short_extend(pre: np.ndarray, ext: np.ndarray) -> bool:
        rows = int(ext.sum())
        key_reads = int((ext * pre).sum()) + int((ext * (ext + 1)).sum()) // 2
        return rows <= _ROWS_MAX_QUERIES and key_reads <= _ROWS_MAX_KEY_READS

    def _group_rows(self, req: np.ndarray, pos: np.ndarray, pages: np.ndarray, ps: int) -> _Group:
        """Every row of the step (request req[t], position pos[t]) as its own decode-kernel row
        in step order: the keys of its request up to its own position (causal by the row's key
        count)."""
        lens = pos + 1
        kp = np.arange(int(lens.max()))[None, :]
        k_slots = _slots(pages, req[:, None], np.minimum(kp, pos[:, None]), ps)
        rows = len(pos)
        call = self._call(
            None, 0, k_slots, np.zeros((rows, 1), np.int64), pos[:, None], False, plan=False
        )
        return _Group(
            calls=[call], out_rows=None, valid=None, lens=self._dev(lens), decode_kernel=True
        )

    def _runs(
        self, pre: np.ndarray, ext: np.ndarray, st: np.ndarray
    ) -> list[tuple[int, int, bool]]:
        """The per-request calls as (first member, members, fresh): fresh prompts of one length
        whose rows follow each other in the step merge into one call over their own K/V (SDPA
        plain calls only: a fresh call has no pool slots for attend_blocked)."""
        fresh = (pre == 0) & (ext > 1) & self.sdpa_plain
        runs: list[tuple[int, int, bool]] = []
        for i in range(len(ext)):
            if runs and fresh[i] and runs[-1][2]:
                first, n, _ = runs[-1]
                if ext[first] == ext[i] and st[first] + n * ext[first] == st[i]:
                    runs[-1] = (first, n + 1, True)
                    continue
            runs.append((i, 1, bool(fresh[i])))
        return runs

    def _group_each(
        self,
        members: np.ndarray,
        pre: np.ndarray,
        ext: np.ndarray,
        st: np.ndarray,
        pages: np.ndarray,
        ps: int,
        num_requests: int,
        runs: list[tuple[int, int, bool]],
    ) -> _Group:
        calls = []
        for i, n, fresh in runs:
            hi = (pre[i] + np.arange(int(ext[i])))[None]  # causal, shifted by the cached prefix
            if fresh:
                hi = np.repeat(hi, n, axis=0)
                calls.append(self._call(None, int(st[i]), None, np.zeros_like(hi), hi, True))
                continue
            k_pos = np.arange(int(pre[i] + ext[i]))
            slots = _slots(pages, np.full_like(k_pos, members[i]), k_pos, ps)[None]
            calls.append(
                self._call(None, int(st[i]), slots, np.zeros_like(hi), hi, bool(pre[i] == 0))
            )
        rows = np.concatenate([np.arange(s, s + e) for s, e in zip(st, ext)])
        identity = len(members) == num_requests and np.array_equal(rows, np.arange(len(rows)))
        return _Group(
            calls=calls,
            out_rows=None if identity else self._dev(rows),
            valid=None,
            lens=self._dev(pre + ext),
            decode_kernel=False,
        )

    def _call(
        self,
        q_rows: torch.Tensor | None,
        start: int,
        k_slots: np.ndarray | None,
        lo: np.ndarray,
        hi: np.ndarray,
        causal: bool,
        plan: bool = True,
    ) -> _Call:
        """One call's device tensors and tile plan (`plan` False: the CPU decode kernel reads
        only the slots; `k_slots` None: a fresh causal call over the step's own rows)."""
        g, num_q = lo.shape
        num_k = num_q if k_slots is None else k_slots.shape[1]
        masked = not (causal or (bool((lo == 0).all()) and bool((hi == num_k - 1).all())))
        blocked = False
        tiles: list[Tile] = []  # none: one SDPA call without a mask, or the decode kernel
        if plan and masked and self.sdpa_masked:  # SDPA per query tile, each with its mask
            rows = self.sdpa_mask_cells // (g * num_k) // 256 * 256
            tiles = plan_tiles(lo, hi, max(self.sdpa_q_tile_min, rows, 1), num_k)
        elif plan and (masked or not self.sdpa_plain):
            blocked = True
            shape = tile_shape(g * self.num_heads, num_q, num_k, self.tile_cells, self.q_tile)
            tiles = plan_tiles(lo, hi, *shape)
        masks = None
        if tiles and not blocked and g * num_q * num_k <= self.sdpa_mask_cells:
            masks = [self._mask(lo, hi, t) for t in tiles]
        return _Call(
            q_rows=q_rows,
            start=start,
            shape=(g, num_q),
            k_slots=None if k_slots is None else self._dev(k_slots),
            lo=self._dev(lo) if tiles and masks is None else None,
            hi=self._dev(hi) if tiles and masks is None else None,
            causal=causal,
            blocked=blocked,
            masks=masks,
            tiles=tiles,
        )

    def _mask(self, lo: np.ndarray, hi: np.ndarray, t: Tile) -> torch.Tensor | None:
        ((k0, k1, masked),) = t.blocks
        if not masked:
            return None
        j = np.arange(k0, k1)
        tlo, thi = lo[:, t.q0 : t.q1, None], hi[:, t.q0 : t.q1, None]
        return self._dev(((j >= tlo) & (j <= thi))[:, None])

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
        if new is None:  # from here on k and v as the cache gives them back (fp8: rounded)
            k, v = self.kv_pool.store(layer_id, meta.out_loc, k, v)
        width = self.num_heads * self.head_dim
        out: torch.Tensor | None = None
        for i, grp in enumerate(meta.groups):
            if grp.prefill_plan is not None:  # the prompts' rows of `out`, in place
                if out is None:
                    out = q.new_empty(meta.num_tokens, width)
                if self._prefill(q, k, v, k_buf, v_buf, grp.prefill_plan, out):
                    continue
                assert grp.fallback is not None
                meta.groups[i] = grp = grp.fallback()  # for the other layers too
            o = self._attend(q, k, v, k_buf, v_buf, grp, new)  # [G * Q, Hq * D]
            if grp.valid is not None:
                o = o[grp.valid]
            if grp.out_rows is None:
                return o
            if out is None:
                out = q.new_empty(meta.num_tokens, width)
            out[grp.out_rows] = o
        assert out is not None
        return out

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        plan: cpu_prefill.Plan,
        out: torch.Tensor,
    ) -> bool:
        """cpu_prefill.attend; over an fp8 cache (the kernel reads bf16) with the cached
        prefixes' rows as the cache gives them back, gathered (k and v are already)."""
        if self.kv_pool.fp8:
            if plan.slots is None:  # no prefix: the kernel never reads the pools
                k_buf, v_buf = k, v
            else:
                k_buf = self.kv_pool.read(k_buf, plan.slots)
                v_buf = self.kv_pool.read(v_buf, plan.slots)
                plan = replace(plan, slots=torch.arange(len(plan.slots)))
        return cpu_prefill.attend(q, k, v, k_buf, v_buf, plan, out, self.scale)

    def decode_chain_inputs(
        self, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(key slots [B, kmax], lengths [B], the new rows' slots [B]) where this step is what
        `forward` would give the CPU decode kernel storing the new rows itself, every row in
        order (the per-layer decode chain's attention: layers/cpu_chain.py); else None."""
        if not self.cpu_decode or not isinstance(meta, TorchMetadata) or len(meta.groups) != 1:
            return None
        grp = meta.groups[0]
        if not (grp.decode_kernel and grp.prefill_plan is None):
            return None
        if grp.out_rows is not None or grp.valid is not None or len(grp.calls) != 1:
            return None
        call = grp.calls[0]
        slots, lens, new = call.k_slots, grp.lens, meta.out_loc
        if call.q_rows is not None or slots is None or meta.num_tokens != lens.shape[0]:
            return None
        for t in (slots, lens, new):
            if t.dtype != torch.int64 or not t.is_contiguous():
                return None
        return slots, lens, new

    def _decode_in_place(
        self, meta: TorchMetadata, k_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        """Whether this step is one query per request, every row in order, for the CPU kernel
        with rows it can store itself."""
        if len(meta.groups) != 1:
            return False
        grp = meta.groups[0]
        return (
            grp.decode_kernel
            and grp.calls[0].q_rows is None
            and grp.out_rows is None
            and grp.valid is None
            and cpu_kernels.can_write_new(k_buf, k, v)
        )

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        grp: _Group,
        new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`new`: the step's rows for the CPU decode kernel to store (see _decode_in_place)."""
        if grp.decode_kernel:
            call = grp.calls[0]
            assert call.k_slots is not None
            qd = q if call.q_rows is None else q[call.q_rows[:, 0]]
            return cpu_kernels.decode_attention(
                qd, k_buf, v_buf, call.k_slots, grp.lens, self.scale, new
            )
        outs = [self._attend_call(q, k, v, k_buf, v_buf, c) for c in grp.calls]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        c: _Call,
    ) -> torch.Tensor:
        g, qn = c.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if c.q_rows is None:
            qg = q[c.start : c.start + g * qn].view(g, qn, hq, d)
        else:
            qg = q[c.q_rows]  # [G, Q, Hq, D]
        if c.k_slots is None:  # fresh prompts: their own K/V rows, as they lie in the step
            rows = slice(c.start, c.start + g * qn)
            kf = k[rows].view(g, qn, hkv, d).transpose(1, 2)
            vf = v[rows].view(g, qn, hkv, d).transpose(1, 2)
            o = self._sdpa(qg.transpose(1, 2), kf, vf, None, True)
            return o.transpose(1, 2).reshape(g * qn, hq * d)
        if c.blocked:
            assert c.lo is not None and c.hi is not None
            o = attend_blocked(qg, k_buf, v_buf, c.k_slots, c.lo, c.hi, c.tiles, self.scale)
            return o.view(g * qn, hq * d)
        # The call's keys once ([G, Hkv, K, D] views), each tile attending to a slice of them.
        flat = c.k_slots.reshape(-1)
        kg = self.kv_pool.read(k_buf, flat)
        vg = self.kv_pool.read(v_buf, flat)
        kg = kg.view(g, -1, self.num_kv_heads, d).transpose(1, 2)
        vg = vg.view(g, -1, self.num_kv_heads, d).transpose(1, 2)
        if not c.tiles:
            o = self._sdpa(qg.transpose(1, 2), kg, vg, None, c.causal)
            return o.transpose(1, 2).reshape(g * qn, hq * d)
        outs = []
        for i, t in enumerate(c.tiles):
            ((k0, k1, masked),) = t.blocks
            mask = None
            if c.masks is not None:
                mask = c.masks[i]
            elif masked:
                assert c.lo is not None and c.hi is not None
                lo, hi = c.lo[:, t.q0 : t.q1], c.hi[:, t.q0 : t.q1]
                mask = ~hidden_keys(lo, hi, k0, k1)[:, None]  # [G, 1, Tq, K]
            qt = qg[:, t.q0 : t.q1].transpose(1, 2)
            o = self._sdpa(qt, kg[:, :, k0:k1], vg[:, :, k0:k1], mask, False)
            outs.append(o.transpose(1, 2))  # [G, Tq, Hq, D]
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return o.reshape(g * qn, hq * d)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """q [G, Hq, Q, D], k/v [G, Hkv, K, D] -> [G, Hq, Q, D]."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
