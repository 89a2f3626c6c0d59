"""Decode CUDA graphs: which bucket a batch replays, how it is padded, when graphs are off."""

from __future__ import annotations

import pytest

from minisgl.engine.cuda_graph import (
    batch_buckets,
    bucket_for,
    graphs_wanted,
    is_graph_decode,
    pad_decode,
)


def test_buckets_are_powers_of_two_up_to_the_max() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(2) == [1, 2]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]  # the max itself is captured
    assert batch_buckets(160) == [1, 2, 4, 8, 16, 32, 64, 128, 160]
    with pytest.raises(ValueError, match="at least 1"):
        batch_buckets(0)


@pytest.mark.parametrize("max_bs", [1, 3, 8, 48, 64, 100])
def test_every_batch_replays_the_smallest_bucket_that_holds_it(max_bs: int) -> None:
    buckets = batch_buckets(max_bs)
    for n in range(1, max_bs + 1):
        b = bucket_for(n, buckets)
        assert b is not None and b >= n
        assert all(c < n for c in buckets if c < b), (n, b)  # no smaller bucket fits
    assert bucket_for(max_bs + 1, buckets) is None  # above the max: eager
    assert bucket_for(0, buckets) is None


def test_padding_rows_are_one_token_requests_on_the_scratch_page() -> None:
    tables = [[3, 4], [7], [9, 10, 11]]
    p = pad_decode([11, 12, 13], [20, 5, 40], tables, 8, page_size=16, scratch_page=99)
    assert p.size == 3
    assert p.token_ids == [11, 12, 13, 0, 0, 0, 0, 0]
    assert p.positions == [20, 5, 40, 0, 0, 0, 0, 0]  # the new token sits at prefix_len
    assert p.layout.prefix_lens == [20, 5, 40, 0, 0, 0, 0, 0]
    assert p.layout.extend_lens == [1] * 8
    assert p.layout.page_tables == tables + [[99]] * 5
    assert p.layout.page_size == 16
    tables[0].append(5)  # the layout holds its own copy
    assert p.layout.page_tables[0] == [3, 4]
    full = pad_decode([1, 2], [0, 0], [[1], [2]], 2, 16, 99)
    assert full.token_ids == [1, 2] and full.layout.page_tables == [[1], [2]]


def test_a_batch_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode([1, 2, 3], [0, 0, 0], [[1], [2], [3]], 2, 16, 99)
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode([], [], [], 2, 16, 99)
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode([1, 2], [0], [[1], [2]], 2, 16, 99)


def test_only_pure_decode_steps_replay() -> None:
    assert is_graph_decode([1, 1, 1], False)
    assert not is_graph_decode([1, 5, 1], False)  # a prefill chunk rides along: eager
    assert not is_graph_decode([1, 1], True)  # prompt logprobs read hidden rows: eager
    assert not is_graph_decode([], False)


def test_graphs_only_on_cuda_with_flashinfer_and_not_when_disabled() -> None:
    assert graphs_wanted(False, "cuda", "flashinfer") is None
    assert graphs_wanted(True, "cuda", "flashinfer") == "--disable-cuda-graph"
    assert "not on CUDA" in (graphs_wanted(False, "cpu", "flashinfer") or "")
    assert "torch attention backend" in (graphs_wanted(False, "cuda", "torch") or "")
