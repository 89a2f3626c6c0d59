"""Log-probabilities reach the host in one copy per call, however many rows asked: on a GPU
every read back is a wait for the device, and reading row by row made a step's waits grow
with its batch."""

from __future__ import annotations

import pytest
import torch

from minisgl.layers import cpu_kernels
from minisgl.layers.logprobs import pick, row_stats, token_logprobs
from minisgl.testing.host_reads import HostReads


@pytest.mark.parametrize("kernels", [True, False])
def test_every_row_comes_back_in_one_read_with_the_same_values(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernels and cpu_kernels.load() is None:
        pytest.skip("no AVX2 kernels here")
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "rows_supported", lambda x: False)
    torch.manual_seed(3)
    x = torch.randn(7, 151_936) * 4
    tokens = torch.randint(0, 151_936, (7,))
    ks = [0, 1, 5, 20, 2, 20, 3]
    stats = row_stats(x, None, max(ks))
    with HostReads() as reads:
        got = token_logprobs(x, tokens, ks)
    assert dict(reads.calls) == {"tolist": 1} and not reads.syncing_ops
    # The values are the float32 results, exactly as a per-row read gave them.
    chosen = x[torch.arange(7), tokens] - stats.lse
    for r, k in enumerate(ks):
        assert got.token_ids[r] == int(tokens[r])
        assert got.logprobs[r] == float(chosen[r])
        assert got.top_ids[r] == stats.top_ids[r, :k].tolist()
        assert got.top_logprobs[r] == (stats.top_values[r, :k] - stats.lse[r]).tolist()


def test_sampled_rows_of_a_batch_come_back_in_one_read() -> None:
    torch.manual_seed(4)
    x = torch.randn(5, 300)
    rows = [0, 2, 3]
    stats = row_stats(x, rows, 4)
    drawn = torch.tensor([7, 299, 0])
    with HostReads() as reads:
        got = pick(x, rows, stats, drawn, [4, 0, 2])
    assert reads.count == 1
    ref = torch.log_softmax(x.double(), dim=-1)
    assert got.token_ids == [7, 299, 0]
    for i, r in enumerate(rows):
        assert got.logprobs[i] == pytest.approx(float(ref[r, drawn[i]]), abs=1e-6)
    assert [len(t) for t in got.top_ids] == [4, 0, 2]
    assert got.top_ids[0] == ref[0].topk(4).indices.tolist()
