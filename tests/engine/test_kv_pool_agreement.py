"""Tensor-parallel ranks whose devices report different free memory build one KV pool size:
the least any rank can hold (gloo on CPU, two real processes). Pools of different sizes would
give the ranks' schedulers different batches, and their collectives different shapes."""

from __future__ import annotations

import logging
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

# What each rank's device says it has free (bytes): rank 1 has a little less, as real GPUs do.
FREE = {0: 6 << 20, 1: (6 << 20) - (600 << 10)}


def _rank(model: str, rank: int, port: int, out: Any, store: Any = None) -> None:
    """One rank: join the group, build the model runner with this rank's free memory."""
    from minisgl import distributed
    from minisgl.config import EngineArgs
    from minisgl.engine import memory
    from minisgl.engine.model_runner import ModelRunner
    from minisgl.models.config import ModelConfig

    real_available = memory.available_bytes
    memory.available_bytes = lambda device: FREE[rank]  # this rank's device
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    keep, log = Keep(level=logging.INFO), logging.getLogger("minisgl.engine.memory")
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        store = store or distributed.rendezvous_store("127.0.0.1", port, 2, rank)
        distributed.init_distributed(rank, 2, device="cpu", store=store)
        args = EngineArgs(
            model=model, dtype="float32", device="cpu", tp_size=2, cpu_kernel_tuning="off"
        )
        runner = ModelRunner(args, Path(model), ModelConfig.from_dir(Path(model)), 512, rank, 2)
        out.put((rank, runner.num_pages, runner.kv_pool.num_pages, records))
    except BaseException as e:
        out.put((rank, None, None, [f"{type(e).__name__}: {e}"]))
    finally:
        distributed.destroy_distributed()
        memory.available_bytes = real_available
        log.removeHandler(keep)


def test_tp_ranks_with_different_free_memory_build_the_smallest_pool(tiny_model_dir, monkeypatch):
    import torch

    from minisgl.distributed import rendezvous_store
    from minisgl.engine import memory
    from minisgl.engine.memory import default_num_pages
    from minisgl.kvcache.kv_pool import KVPool
    from minisgl.models.config import ModelConfig

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = rendezvous_store("127.0.0.1", 0, 2, 0)  # the kernel's port, listening already
    follower = ctx.Process(
        target=_rank, args=(str(tiny_model_dir), 1, store.port, out), daemon=True
    )
    follower.start()
    _rank(str(tiny_model_dir), 0, store.port, out, store)  # rank 0 here, as the server runs it
    results = {}
    for _ in range(2):
        rank, num_pages, pool_pages, logs = out.get(timeout=100)
        assert num_pages is not None, logs
        results[rank] = (num_pages, pool_pages, logs)
    follower.join(timeout=30)

    config = ModelConfig.from_dir(tiny_model_dir)
    per_page = KVPool.bytes_per_page(
        config.num_hidden_layers,
        16,
        config.num_key_value_heads // 2,
        config.head_dim,
        torch.float32,
    )

    def fits(free: int) -> int:
        monkeypatch.setattr(memory, "available_bytes", lambda device: free)
        return default_num_pages(
            bytes_per_page=per_page,
            page_size=16,
            max_seq_len=512,
            max_running_requests=256,
            memory_fraction=0.85,
            device=torch.device("cpu"),
        )

    own = {r: fits(FREE[r]) for r in FREE}
    assert own[0] > own[1], "the ranks' own figures must differ for this test to mean anything"
    assert results[0][:2] == results[1][:2] == (own[1], own[1])
    # Said once (rank 0), with every rank's figure.
    said = [m for m in results[0][2] + results[1][2] if "the ranks can hold" in m]
    assert said == [
        f"KV cache: the ranks can hold {own[0]}, {own[1]} pages (rank order); "
        f"every rank builds {own[1]}"
    ]
