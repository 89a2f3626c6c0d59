"""A quantized LM head split over tensor-parallel ranks (layers/embedding.py): each rank holds
its rows of the vocabulary as codes (the last rank's padding rows zero), looks up the ids it
owns from them, and multiplies by them through the quantized matmul. Layer level: the ranks'
collectives are the identity here, each rank checked on its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minisgl import distributed
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.quant.attach import attach_head
from minisgl.quant.qtensor import dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import head_scheme
from minisgl.quant.weight import QuantWeight

VOCAB, HIDDEN = 301, 128  # odd: rank 1 of 2 has a padding row


def _rank(rank: int, method: str) -> tuple[VocabParallelEmbedding, ParallelLMHead]:
    """One rank's tied embedding and head, built as the loader builds them."""
    with torch.device("meta"):
        embed = VocabParallelEmbedding(VOCAB, HIDDEN, rank, 2)
        head = ParallelLMHead(VOCAB, HIDDEN, rank, 2)
        head.tie(embed)
    model = nn.ModuleDict({"embed": embed, "head": head}).to(torch.bfloat16)
    assert attach_head(model, head_scheme(method)) == 1
    model.to_empty(device="cpu")
    head.tie(embed)
    return embed, head


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_each_rank_looks_up_and_multiplies_its_rows_of_the_quantized_table(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(distributed, "all_reduce", lambda t: t)
    full = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    q = quantize(full, head_scheme(method))
    ref = dequantize(q, torch.float32)
    ids = torch.tensor([0, 5, 150, 151, 300])
    x = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    for rank in range(2):
        embed, head = _rank(rank, method)
        assert isinstance(head.weight, QuantWeight) and embed.weight is head.weight
        assert not list(embed.parameters()) and not list(head.parameters())
        embed.load(q)
        owned = (ids >= embed.start) & (ids < embed.end)
        out = embed(ids)
        assert out.dtype == torch.bfloat16
        want = torch.where(owned.unsqueeze(-1), ref[ids.clamp(max=VOCAB - 1)], 0.0)
        assert torch.equal(out, want.to(torch.bfloat16))
        local = ref[embed.start : embed.end]
        y = head.weight.matmul(x).float()
        assert y.shape == (3, embed.rows)
        assert not y[:, local.shape[0] :].any()  # the padding row
        expect = x.float() @ local.t()
        err = (y[:, : local.shape[0]] - expect).norm() / expect.norm()
        assert err < 0.02, f"relative error {err:.4f}"
