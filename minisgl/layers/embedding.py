"""Vocab-parallel token embedding and LM head.

Rank r holds rows [r * V_r, (r + 1) * V_r) of the (padded) vocabulary. The embedding looks up
the ids it owns, zeroes the rest and all-reduces; the LM head computes the logits of its rows
and all-gathers them. Both use the same row split, so a tied LM head shares the tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import distributed
from minisgl.layers import cpu_kernels
from minisgl.layers.cpu_kernels import PanelWeight
from minisgl.layers.cpu_linear import CpuLinearKernel


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rows = -(-vocab_size // tp_size)  # ceil: the last rank's tail is zero padding
        self.start = tp_rank * self.rows
        self.end = min(self.start + self.rows, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        # Set where a tied LM head's panels are the only copy of the table (see use_panels).
        self.panels: PanelWeight | None = None

    def use_panels(self, panels: PanelWeight) -> None:
        """Look rows up in `panels` (the tied LM head's copy) and drop the row-major table."""
        self.panels = panels
        self.weight = nn.Parameter(self.weight.to("meta"), requires_grad=False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return cpu_kernels.panel_rows(self.panels, ids)
        return F.embedding(ids, self.weight)

    def load(self, full: torch.Tensor) -> None:
        n = self.end - self.start
        self.weight.data[:n].copy_(full[self.start : self.end])
        self.weight.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        owned = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(owned, input_ids - self.start, 0)
        out = self._lookup(local) * owned.unsqueeze(-1).to(self.weight.dtype)
        return distributed.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the whole vocabulary from this rank's vocab rows (float32 out)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp_rank, tp_size)
        self.kernel: CpuLinearKernel | None = None  # see LinearBase.kernel
        self.kernel_out_dtype: torch.dtype | None = torch.float32

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            logits = self.kernel(hidden)
        else:
            logits = F.linear(hidden, self.weight)
        logits = logits.float()
        if self.tp_size > 1:
            logits = distributed.all_gather(logits, dim=-1)[:, : self.vocab_size]
        return logits
