"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Randomness: a request's draw at step s inverts the CDF of its filtered distribution (token-id
order) at a uniform number that is a pure function of (seed, step), computed by an integer hash
with plain torch ops. So the same seed gives the same tokens no matter which other requests share
the batch, and the whole batch is sampled in one go, with one random number per row and no
per-row generators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from minisgl.layers import cpu_kernels
from minisgl.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF
# Without the CPU kernels, rows asking for top-p alone first look for their nucleus among this
# many top candidates (a partial sort); only when it is not inside do they pay for a full sort
# of the vocabulary. With them, a radix select finds each such row's cutoff without a sort.
NUCLEUS_CANDIDATES = 1024
# Returned for a row whose logits hold NaN or +inf (or nothing finite): it has no distribution
# to draw from, so its request must end with an error, never with an arbitrary token id.
INVALID_TOKEN = -1


@dataclass
class SamplingBatch:
    all_greedy: bool
    any_greedy: bool
    greedy_rows: list[bool]
    temperatures: list[float]  # 1 for greedy rows
    top_k: torch.Tensor | None  # [B] long, 0 where disabled; None: none set
    top_p: torch.Tensor | None  # [B] float32; None: none set
    min_p: torch.Tensor | None  # [B] float32; None: none set
    seeds: list[int]
    steps: list[int]
    device: torch.device | str
    candidates: int = 0  # top candidates that hold every filtered row's kept set (see below)
    top_k_max: int = 0  # the largest top_k asked (0: none)

    @cached_property
    def greedy(self) -> torch.Tensor:
        """[B] bool, made on first use: an all-greedy batch (a decode step's usual case) never
        reads it, and each small tensor is a few torch ops on cold caches in a 1-row step."""
        return torch.tensor(self.greedy_rows, dtype=torch.bool).to(self.device)

    @cached_property
    def temperature(self) -> torch.Tensor:
        """[B] float32, made on first use (as `greedy`)."""
        return torch.tensor(self.temperatures, dtype=torch.float32).to(self.device)

    @cached_property
    def keys(self) -> torch.Tensor:
        """[B] int64: 32-bit hash of (seed, step), made on first use: only a random draw reads
        it, and it is ~40 small torch ops a step that an all-greedy batch never needs."""

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device)

        # Any Python int seed: its low and high 32-bit halves are hashed together with the step.
        lo = [s & _M32 for s in self.seeds]
        hi = [(s >> 32) & _M32 for s in self.seeds]
        keys = _hash32(_hash32(dev(lo)) ^ dev(hi))
        return _hash32(keys ^ dev([s & _M32 for s in self.steps]))

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        steps: list[int],
        seeds: list[int],
        device: torch.device | str,
    ) -> SamplingBatch:
        greedy = [p.greedy for p in params]
        if all(greedy):  # a decode step's usual case: what the lists below give for it
            n = len(params)
            return cls(
                all_greedy=True,
                any_greedy=n > 0,
                greedy_rows=greedy,
                temperatures=[1.0] * n,
                top_k=None,
                top_p=None,
                min_p=None,
                seeds=list(seeds),
                steps=list(steps),
                device=device,
            )
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        # top_k as given; 0 or -1 = off (0 here), resolved against the vocabulary later.
        top_k = [0 if g or p.top_k <= 0 else p.top_k for p, g in zip(params, greedy, strict=True)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        top_p_only = any(k == 0 and p < 1.0 for k, p in zip(top_k, top_p, strict=True))
        candidates = max(top_k + [NUCLEUS_CANDIDATES if top_p_only else 0])
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        return cls(
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            greedy_rows=greedy,
            temperatures=temps,
            top_k=dev(top_k, torch.int64) if any(top_k) else None,
            top_p=dev(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            min_p=dev(min_p, torch.float32) if any(m > 0.0 for m in min_p) else None,
            seeds=list(seeds),
            steps=list(steps),
            device=device,
            candidates=candidates,
            top_k_max=max(top_k),
        )


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 32-bit x without int64 overflow: split off c's top bit."""
    y = x * (c & 0x7FFFFFFF)
    if c & 0x80000000:
        y = y + ((x & 1) << 31)
    return y & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, 'lowbias32' constants) on int64 tensors."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """One U(0, 1) float64 per key, a pure function of it (48 random bits, never 0 or 1)."""
    hi = _hash32(keys ^ 0x5BD1E995) >> 8
    lo = _hash32(keys + 0x68E31DA4) >> 8
    return ((hi << 24) + lo).to(torch.float64).add_(0.5).mul_(2.0**-48)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (not renormalised): [B, V]."""
    probs = torch.softmax(logits / batch.temperature[:, None], dim=-1)
    vocab = probs.shape[-1]
    if batch.top_k is not None or batch.top_p is not None:
        top_k = batch.top_k if batch.top_k is not None else torch.zeros_like(batch.temperature)
        top_k = torch.where(top_k > 0, top_k, vocab).long()
        top_p = batch.top_p if batch.top_p is not None else torch.ones_like(batch.temperature)
        p_only = (top_k == vocab) & (top_p < 1.0)
        active = (top_k < vocab) | (top_p < 1.0)
        if batch.top_p is not None and cpu_kernels.rows_supported(probs):
            # Top-p alone: each row's cutoff by radix select (no sort); rows with a top_k go
            # through their top_k best below.
            cutoff = cpu_kernels.nucleus_cutoff(probs, torch.where(p_only, top_p, 1.0))
            filtered = torch.where(probs >= cutoff[:, None], probs, 0.0)
            if batch.top_k_max:
                # top-p rows are done: hidden from the ranked filter, or a nucleus wider than
                # the largest top_k would make it sort the vocabulary for nothing.
                rest_p = torch.where(p_only, 1.0, top_p)
                ranked = _ranked_filter(probs, top_k, rest_p, min(vocab, batch.top_k_max))
                filtered = torch.where(p_only[:, None], filtered, ranked)
        else:
            filtered = _ranked_filter(probs, top_k, top_p, min(vocab, batch.candidates))
        probs = torch.where(active[:, None], filtered, probs)
    if batch.min_p is not None:
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < batch.min_p[:, None] * top, 0.0)
    return probs


def _ranked_filter(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k: int
) -> torch.Tensor:
    """Top-k and top-p by rank among the k best of each row (k >= every row's top_k; a top-p
    row whose nucleus is not inside them makes the whole batch sort the vocabulary)."""
    vocab = probs.shape[-1]
    values, ids = probs.topk(k, dim=-1)  # sorted, descending
    mass_before = values.cumsum(dim=-1) - values
    p_only = (top_k == vocab) & (top_p < 1.0)
    if k < vocab and bool((p_only & (mass_before[:, -1] + values[:, -1] < top_p)).any()):
        values, ids = probs.sort(dim=-1, descending=True)
        mass_before = values.cumsum(dim=-1) - values
        k = vocab
    # Keep the top_k best, and the smallest prefix whose mass reaches top_p (a token is
    # dropped when the mass strictly before it already does; the best is always kept).
    rank = torch.arange(k, device=probs.device)[None, :]
    # rank 0 is kept outright: a top_p that rounds to 0 in float32 (5e-324) must still
    # leave the best token, not an empty distribution.
    keep = (rank < top_k[:, None]) & ((mass_before < top_p[:, None]) | (rank == 0))
    return torch.zeros_like(probs).scatter_(-1, ids, values * keep)


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.max(logits, dim=-1), by the C kernel on the CPU: torch's max-with-index over a
    150k vocabulary is not vectorised there (~2.5 ms for 16 rows, against ~0.3)."""
    if cpu_kernels.rows_supported(logits):
        return cpu_kernels.rows_argmax(logits)
    return logits.max(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token per row of `logits` [B, V] (float32) -> [B] long (INVALID_TOKEN: no draw)."""
    top, best = row_max(logits)  # NaN propagates into `top`
    if batch.all_greedy and all(math.isfinite(v) for v in top.tolist()):
        # A decode step's usual case: the check in Python (~2 us) instead of two torch ops on
        # a few values (~25 us, 1 thread, AMD EPYC VM).
        return best
    valid = torch.isfinite(top)
    if batch.all_greedy:
        return torch.where(valid, best, INVALID_TOKEN)
    probs = filtered_probs(logits, batch)
    # Inverse-CDF draw over the vocabulary in token-id order: one random number per row, and
    # a zero-probability token (a flat step of the CDF) can never be hit. float32 is plenty:
    # the rounding shifts probabilities by ~1e-7 of the total.
    cdf = probs.cumsum(dim=-1)
    target = (uniform(batch.keys) * cdf[:, -1]).to(cdf.dtype)
    drawn = torch.searchsorted(cdf, target[:, None]).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    if batch.any_greedy:
        drawn = torch.where(batch.greedy, best, drawn)
    valid &= batch.greedy | (cdf[:, -1] > 0)  # a NaN total fails the comparison too
    return torch.where(valid, drawn, INVALID_TOKEN)
