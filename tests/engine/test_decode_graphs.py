"""Decode CUDA graphs, capture and replay path, run on the CPU.

The graph is a stand-in that records the captured function and re-runs it on replay, writing
into the output tensor the capture returned, as a CUDA graph replays into its static output.
flashinfer is the pure-torch stand-in of flashinfer_standin.py. So everything a replay depends
on must be in the static buffers the runner refills (token ids, positions, the decode wrapper's
page buffers, the new tokens' slots): a value captured once, or read from the step's own
tensors, shows up as tokens that differ from the eager run.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from flashinfer_standin import module as flashinfer_module

from minisgl import LLM, SamplingParams
from minisgl.engine import cuda_graph
from minisgl.layers.attention import flashinfer_backend
from minisgl.logprobs import TokenLogprobs


class CallGraph:
    """Replays by calling the captured function again, into the captured output."""

    replays: dict[int, int] = {}  # rows of the captured output -> replays

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())
        CallGraph.replays[self.out.shape[0]] = CallGraph.replays.get(self.out.shape[0], 0) + 1


@pytest.fixture(scope="module")
def graph_path() -> Iterator[type[CallGraph]]:
    """flashinfer and graphs on the CPU, through the stand-ins."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "flashinfer", flashinfer_module())
        mp.setattr(flashinfer_backend, "DEVICE_TYPES", ("cuda", "cpu"))
        mp.setattr(cuda_graph, "DEVICE_TYPES", ("cuda", "cpu"))
        mp.setattr(cuda_graph, "GRAPH_FACTORY", lambda: CallGraph)
        CallGraph.replays = {}
        yield CallGraph


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(0, 151643) for _ in range(n)] for n in (3, 17, 40, 9, 70, 25)]


def _llm(model_dir: Path, **kw: object) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        num_pages=128,
        page_size=16,
        cpu_kernel_tuning="off",
        **kw,
    )


def _generate(llm: LLM) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
    # Lengths differ, so the running batch shrinks 6 -> 1: eager above the max, then buckets
    # 4 (batches of 4 and 3: one padding row), 2 and 1.
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2 if m == 9 else None)
        for m in (4, 6, 9, 12, 15, 20)
    ]
    outs = llm.generate(_prompts(), params)
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.fixture(scope="module")
def eager_run(tiny_model_dir: Path) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
    llm = _llm(tiny_model_dir, attention_backend="torch")
    assert llm.engine.runner.decode_graphs is None  # not on CUDA: eager
    return _generate(llm)


@pytest.fixture(scope="module")
def graph_llm(tiny_model_dir: Path, graph_path: type[CallGraph]) -> LLM:
    return _llm(tiny_model_dir, attention_backend="flashinfer", cuda_graph_max_bs=4)


@pytest.fixture(scope="module")
def graph_run(graph_llm: LLM) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
    return _generate(graph_llm)


def test_replayed_decode_matches_eager(
    tiny_model_dir: Path, graph_path: type[CallGraph], graph_llm: LLM, graph_run, eager_run
) -> None:
    want, want_lp = eager_run
    fi_eager = _llm(tiny_model_dir, attention_backend="flashinfer", disable_cuda_graph=True)
    assert fi_eager.engine.runner.decode_graphs is None
    assert _generate(fi_eager)[0] == want
    graphs = graph_llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4]
    got, got_lp = graph_run
    assert got == want
    assert graph_path.replays.keys() == {1, 2, 4}  # every bucket served some step
    assert graphs.replays == sum(graph_path.replays.values())
    # The logprobs come from the static output's rows, read before the next replay.
    for a, b in zip(got_lp, want_lp, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.token_ids == b.token_ids and a.top_ids == b.top_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_padding_writes_only_the_scratch_page(graph_llm: LLM, graph_run) -> None:
    runner = graph_llm.engine.runner
    # The scheduler's pages are the runner's; the pool has one more, the scratch page.
    assert graph_llm.engine.scheduler.stats().num_pages_total == runner.num_pages
    pool = runner.kv_pool
    assert pool.num_pages == runner.num_pages + 1
    scratch = slice(runner.num_pages * pool.page_size, (runner.num_pages + 1) * pool.page_size)
    assert pool.k_buffers[0][scratch].abs().sum() > 0  # padding rows wrote there


def test_batches_above_the_max_and_prefill_steps_run_eagerly(graph_llm: LLM, graph_run) -> None:
    graphs = graph_llm.engine.runner.decode_graphs
    assert graphs is not None
    before = graphs.replays
    # Five requests decoding together, the same length each: every decode step has 5 rows.
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    graph_llm.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9], [3, 3], [5]], params)
    assert graphs.replays == before


def test_a_failed_capture_leaves_decode_eager(
    tiny_model_dir: Path,
    graph_path: type[CallGraph],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Refused(CallGraph):
        def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graph, "GRAPH_FACTORY", lambda: Refused)
    with caplog.at_level(logging.WARNING, logger="minisgl.engine.cuda_graph"):
        llm = _llm(tiny_model_dir, attention_backend="flashinfer")
    assert llm.engine.runner.decode_graphs is None
    assert "CUDA graphs off: capturing decode failed" in caplog.text
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3  # served eagerly


def test_a_max_batch_below_one_is_refused_at_start(
    tiny_model_dir: Path, graph_path: type[CallGraph]
) -> None:
    with pytest.raises(ValueError, match="--cuda-graph-max-bs must be >= 1, got 0"):
        _llm(tiny_model_dir, attention_backend="flashinfer", cuda_graph_max_bs=0)
