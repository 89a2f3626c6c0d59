"""--quantization at load quantizes a big weight a block of rows at a time: the same codes as
the whole tensor at once, without the whole tensor's float32 temporaries (an 8B model's LM head,
151936 x 4096, took ~4 GB more than its bf16 bytes while it was quantized)."""

from __future__ import annotations

import pytest
import torch

from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import head_scheme, load_scheme


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("head", [False, True])
def test_chunked_codes_equal_whole(method: str, head: bool) -> None:
    scheme = head_scheme(method) if head else load_scheme(method)
    w = torch.randn(1000, 384, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = quantize(w, scheme, chunk_rows=1 << 20)
    chunked = quantize(w, scheme, chunk_rows=100)
    assert torch.equal(whole.codes.view(torch.uint8), chunked.codes.view(torch.uint8))
    assert torch.equal(whole.scales, chunked.scales)
    assert (whole.zeros is None) == (chunked.zeros is None)
    if whole.zeros is not None and chunked.zeros is not None:
        assert torch.equal(whole.zeros, chunked.zeros)
    assert (whole.bits, whole.group_size, whole.in_features) == (
        chunked.bits,
        chunked.group_size,
        chunked.in_features,
    )


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_a_big_weight_is_quantized_a_block_of_rows_at_a_time(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float32 temporaries are a block's, not the whole weight's (an 8B LM head's whole
    int8 pass grew the process by ~6x its bf16 bytes, fp8's ~10x; blocks of 4096 rows ~1.3x)."""
    from minisgl.quant import quantize as module

    seen: list[int] = []
    real = module._quantize

    def spy(w: torch.Tensor, scheme):  # noqa: ANN001, ANN202
        seen.append(w.shape[0])
        return real(w, scheme)

    monkeypatch.setattr(module, "_quantize", spy)
    w = torch.zeros(module.CHUNK_ROWS * 3 + 128, 256, dtype=torch.bfloat16)
    q = quantize(w, load_scheme(method))
    assert max(seen) <= module.CHUNK_ROWS and sum(seen) == w.shape[0]
    assert q.codes.shape[0] == w.shape[0] and q.scales.shape[0] == w.shape[0]
