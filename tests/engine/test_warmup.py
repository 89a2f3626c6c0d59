"""The engine is not ready until its attention kernels exist: building it runs one tiny prefill
and a decode through the chosen backend (on CUDA, what loads or compiles FlashInfer's kernels
for the model's head layout), so the server's /health, which waits for the engine, turns 200
only after them, and the first request never pays for them."""

from __future__ import annotations

import logging

import pytest

from minisgl.config import EngineArgs
from minisgl.engine.engine import Engine
from minisgl.layers.attention.base import BatchLayout
from minisgl.layers.attention.torch_backend import TorchAttentionBackend


def test_building_the_engine_runs_a_prefill_and_a_decode_through_attention(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    prepared: list[tuple[list[int], list[int]]] = []
    layers: list[int] = []
    real_prepare, real_forward = TorchAttentionBackend.prepare, TorchAttentionBackend.forward

    def prepare(self, layout: BatchLayout):  # noqa: ANN001, ANN202
        prepared.append((list(layout.prefix_lens), list(layout.extend_lens)))
        return real_prepare(self, layout)

    def forward(self, q, k, v, layer_id, meta):  # noqa: ANN001, ANN202
        layers.append(layer_id)
        return real_forward(self, q, k, v, layer_id, meta)

    monkeypatch.setattr(TorchAttentionBackend, "prepare", prepare)
    monkeypatch.setattr(TorchAttentionBackend, "forward", forward)
    caplog.set_level(logging.INFO, logger="minisgl.engine.model_runner")
    args = EngineArgs(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_pages=8,
        cpu_kernel_tuning="off",
    )
    engine = Engine(args)
    # Done before the constructor returned, i.e. before any worker can report ready.
    assert prepared == [([0], [2]), ([2], [1])]
    num_layers = engine.model_config.num_hidden_layers
    # Where the CPU decode chain runs a step (layers/cpu_chain.py: the decode, and a prefill
    # this short), its layers' attention kernel is called from the chain, not through the
    # backend's forward.
    chains = engine.runner.model.__dict__.get("_cpu_chains", {})
    chained = {rows for (rows, *_), chain in chains.items() if chain is not None}
    steps_apart = len({2, 1} - chained)
    assert layers == list(range(num_layers)) * steps_apart
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
    assert "the torch attention backend (4 heads, 2 KV heads of" in line
    # It left no trace in the engine's books: every page free, nothing running.
    stats = engine.stats()
    assert stats.num_pages_free == 8 and stats.num_running == 0


def test_a_pool_of_one_slot_still_warms_up(tiny_model_dir) -> None:
    args = EngineArgs(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_pages=1,
        page_size=1,
        cpu_kernel_tuning="off",
    )
    Engine(args)  # a one-token prefill, nothing to decode after it
