"""Log-probabilities of chosen tokens and their top alternatives, from raw logits.

Computed only for the rows that ask, in float32, before any temperature, penalty or filter
(as vLLM reports by default). Prompt scoring needs the logits of every prompt position: those
are produced a block of rows at a time, so a long prompt never holds [tokens, vocab] at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.logprobs import TokenLogprobs

# Rows of logits materialised at once when scoring a prompt (~64 MiB of float32 logits for a
# 150k vocabulary): large enough for whole-block ops, small enough for any device.
PROMPT_BLOCK_BYTES = 64 << 20


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> TokenLogprobs:
    """Log-probabilities of `tokens` [R] under `logits` [R, V], with the top ks[r] of row r."""
    # log_softmax, not logits - logsumexp: on CPU it is one fused pass, logsumexp several.
    return pick(torch.log_softmax(logits.float(), dim=-1), tokens, ks)


def pick(lsm: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> TokenLogprobs:
    """As token_logprobs, from log-probabilities [R, V] already computed."""
    chosen = lsm.gather(1, tokens[:, None]).squeeze(1).tolist()
    kmax = max(ks, default=0)
    top_v: list[list[float]] = [[] for _ in ks]
    top_i: list[list[int]] = [[] for _ in ks]
    if kmax > 0:
        values, ids = lsm.topk(min(kmax, lsm.shape[-1]), dim=-1)
        top_v, top_i = values.tolist(), ids.tolist()
    out = TokenLogprobs()
    for r, k in enumerate(ks):
        out.append(int(tokens[r]), chosen[r], top_i[r][:k], top_v[r][:k])
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
