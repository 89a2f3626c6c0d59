"""Log-probabilities of chosen tokens and their top alternatives, from raw logits.

Computed only for the rows that ask, in float32, before any temperature, penalty or filter
(as vLLM reports by default). Prompt scoring needs the logits of every prompt position: those
are produced a block of rows at a time, so a long prompt never holds [tokens, vocab] at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl.layers import cpu_kernels
from minisgl.logprobs import TokenLogprobs

# Rows of logits materialised at once when scoring a prompt (~64 MiB of float32 logits for a
# 150k vocabulary): large enough for whole-block ops, small enough for any device.
PROMPT_BLOCK_BYTES = 64 << 20


@dataclass
class RowStats:
    """What log-probabilities need of raw logits rows [R, V]: each row's log-normaliser and
    its k best logits (descending) with their ids."""

    lse: torch.Tensor  # [R] float32
    top_values: torch.Tensor  # [R, k] float32 (raw logits, not yet normalised)
    top_ids: torch.Tensor  # [R, k] long


def row_stats(logits: torch.Tensor, rows: list[int] | None, k: int) -> RowStats:
    """Stats of rows `rows` of `logits` [B, V] (all when None): one pass over each row, in
    place, on the CPU (C kernel); logsumexp + topk elsewhere. Neither builds a [R, V]
    log_softmax: only k + 1 numbers per row are ever read from it."""
    if cpu_kernels.rows_supported(logits):
        return RowStats(*cpu_kernels.rows_logprob(logits, rows, k))
    x = (logits if rows is None else logits[rows]).float()
    k = min(k, x.shape[-1])
    values, ids = x.topk(k, dim=-1) if k > 0 else (x[:, :0], x[:, :0].long())
    return RowStats(torch.logsumexp(x, dim=-1), values, ids)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> TokenLogprobs:
    """Log-probabilities of `tokens` [R] under `logits` [R, V], with the top ks[r] of row r."""
    return pick(logits, None, row_stats(logits, None, max(ks, default=0)), tokens, ks)


def pick(
    logits: torch.Tensor,
    rows: list[int] | None,
    stats: RowStats,
    tokens: torch.Tensor,
    ks: list[int],
) -> TokenLogprobs:
    """As token_logprobs, from the stats of rows `rows` (all when None) already computed;
    `logits` must hold the raw values at (row, token)."""
    at = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows
    chosen = logits[at, tokens].float() - stats.lse
    top_v = stats.top_values - stats.lse[:, None]
    # Every row in one device->host copy (each is a wait for the GPU): float64 holds the token
    # ids and the float32 values exactly. Row r: [token, its logprob, top ids..., top values...]
    k_all = stats.top_ids.shape[1]
    parts = (tokens.reshape(-1, 1), chosen.reshape(-1, 1), stats.top_ids, top_v)
    rows_out = torch.cat([p.to(torch.float64) for p in parts], dim=1)
    out = TokenLogprobs()
    for row, want in zip(rows_out.tolist(), ks):
        k = min(want, k_all)  # a vocabulary smaller than k has fewer alternatives
        ids = [int(i) for i in row[2 : 2 + k]]
        out.append(int(row[0]), row[1], ids, row[2 + k_all : 2 + k_all + k])
    return out


def prompt_logprobs(
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    vocab: int,
    targets: torch.Tensor,
    k: int,
) -> TokenLogprobs:
    """Log-probabilities of `targets` [M] (the next tokens) from final hidden states [M, H]."""
    out = TokenLogprobs()
    step = max(1, PROMPT_BLOCK_BYTES // (vocab * 4))
    for start in range(0, hidden.shape[0], step):
        end = min(start + step, hidden.shape[0])
        logits = lm_head(hidden[start:end])
        out.extend(token_logprobs(logits, targets[start:end], [k] * (end - start)))
    return out
