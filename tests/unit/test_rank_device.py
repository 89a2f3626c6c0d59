"""Each tensor-parallel rank gets a GPU of its own, or the start is refused with the reason."""

from __future__ import annotations

import pytest

from minisgl.config import EngineArgs
from minisgl.engine.multinode import rank_device


def args(tp_size: int, nnodes: int = 1, node_rank: int = 0) -> EngineArgs:
    return EngineArgs(
        model="m", tp_size=tp_size, nnodes=nnodes, node_rank=node_rank, dist_init_addr="h:5000"
    )


def test_ranks_take_the_node_s_gpus_in_order() -> None:
    assert [rank_device(r, args(4), 4) for r in range(4)] == [0, 1, 2, 3]
    assert [rank_device(r, args(2), 8) for r in range(2)] == [0, 1]
    # Node 1 of 2 runs ranks 4..7 on its own GPUs 0..3.
    assert [rank_device(r, args(8, 2, 1), 4) for r in range(4, 8)] == [0, 1, 2, 3]


def test_more_ranks_than_visible_gpus_is_refused() -> None:
    """Before: rank % device_count put ranks 0 and 2 on GPU 0 (NCCL fails later: duplicate
    GPU)."""
    with pytest.raises(ValueError, match=r"runs 4 ranks on this node but it sees 2 CUDA device"):
        rank_device(2, args(4), 2)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES and --nnodes"):
        rank_device(5, args(8, 2, 1), 2)
