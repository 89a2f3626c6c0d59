"""Vocab-parallel token embedding and LM head.

Rank r holds rows [r * V_r, (r + 1) * V_r) of the (padded) vocabulary. The embedding looks up
the ids it owns, zeroes the rest and all-reduces; the LM head computes the logits of its rows
and all-gathers them. Both use the same row split, so a tied LM head shares the tensor.

A quantized LM head (--lm-head-quantization, minisgl/quant/) holds a QuantWeight in place of
its float weight; tied, the embedding holds the same one and dequantizes the rows it looks
up, so the table is in memory once, quantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import distributed
from minisgl.layers import cpu_kernels
from minisgl.layers.cpu_kernels import PanelWeight
from minisgl.layers.cpu_linear import CpuLinearKernel
from minisgl.quant.qtensor import QTensor
from minisgl.quant.weight import QuantWeight


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
        # The dtype rows come out in when the table is quantized (it has none of its own).
        self._quantized_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self._quantized_dtype or self.weight.dtype

    def use_quantized(self, table: QuantWeight) -> None:
        """Look rows up in `table` (a quantized tied LM head), dequantizing only those rows."""
        self._quantized_dtype = self.weight.dtype
        del self.weight
        self.weight = table  # type: ignore[assignment]
        table.looked_up = True

    def use_panels(self, panels: PanelWeight) -> None:
        """Look rows up in `panels` (the tied LM head's copy) and drop the row-major table."""
        self.panels = panels
        self.weight = nn.Parameter(self.weight.to("meta"), requires_grad=False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantWeight):
            return self.weight.rows(ids, self.dtype)
        if self.panels is not None:
            return cpu_kernels.panel_rows(self.panels, ids)
        return F.embedding(ids, self.weight)

    def load(self, full: torch.Tensor | QTensor) -> None:
        n = self.end - self.start
        if isinstance(full, QTensor):
            assert isinstance(self.weight, QuantWeight), "a quantized tensor for a float table"
            self.weight.load_rows(full.narrow(0, self.start, n))
            return
        assert isinstance(self.weight, torch.Tensor), "a float tensor for a quantized table"
        self.weight.data[:n].copy_(full[self.start : self.end])
        self.weight.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        owned = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(owned, input_ids - self.start, 0)
        out = self._lookup(local) * owned.unsqueeze(-1).to(self.dtype)
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

    def quantize_as(self, holder: QuantWeight, tied_to: VocabParallelEmbedding | None) -> None:
        """Hold `holder` in place of the float weight (before materialising: the float one is
        never allocated); tied, the embedding looks its rows up in it."""
        self._quantized_dtype = self.weight.dtype
        del self.weight
        self.weight = holder  # type: ignore[assignment]
        if tied_to is not None:
            tied_to.use_quantized(holder)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantWeight):  # the quantized linears' CPU kernels / GPU path
            # The kernel writes float32 itself (fp32 sums, as the float head's kernel does).
            logits = self.weight.matmul(hidden, self.kernel_out_dtype)
        elif self.kernel is not None:
            logits = self.kernel(hidden)
        else:
            logits = F.linear(hidden, self.weight)
        logits = logits.float()
        if self.tp_size > 1:
            logits = distributed.all_gather(logits, dim=-1)[:, : self.vocab_size]
        return logits
