"""Decode steps replayed as CUDA graphs, one graph per padded batch size.

At small batch a decode step is a few hundred short kernels; launching them costs more than
running them. So at start the runner captures one graph per batch-size bucket (1, 2, 4, 8, ...
up to --cuda-graph-max-bs) and a decode batch of B requests replays the smallest bucket that
holds it. What a graph reads lives in static buffers filled before each replay (token ids,
positions; the attention backend's page indices and new-token slots), and its logits land in
a static output whose first B rows are the batch's. Rows past B are padding: a one-token request
on a scratch page the allocator never hands out, so the K/V they write hurt no one. Sampling
runs outside the graph (it is per-request Python and variable-shape).

Only attention backends that can plan a fixed-shape decode outside the graph take part
(`DecodeGraphAttention`: FlashInfer's CUDA-graph decode wrapper); the torch backend's decode
gathers keys padded to the longest context, a shape that changes every step, so it runs eagerly.
Prefill or mixed steps and batches above the largest bucket run eagerly too.

The bucket and padding logic below is plain Python (tested exhaustively on the CPU); the graph
itself is behind `GRAPH_FACTORY` so the capture/replay path can be exercised on the CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from minisgl.layers.attention.base import AttentionMetadata, BatchLayout

logger = logging.getLogger(__name__)

# Devices whose runners capture graphs (tests widen it to exercise the path on the CPU).
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# Attention backends that implement DecodeGraphAttention.
GRAPH_BACKENDS = ("flashinfer",)


def batch_buckets(max_bs: int) -> list[int]:
    """Padded batch sizes captured: powers of two below `max_bs`, then `max_bs` itself."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be at least 1, got {max_bs}")
    out = []
    b = 1
    while b < max_bs:
        out.append(b)
        b *= 2
    return out + [max_bs]


def bucket_for(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `batch_size` requests; None: run eagerly."""
    return next((b for b in buckets if b >= batch_size), None) if batch_size >= 1 else None


def graphs_wanted(disable: bool, device_type: str, backend: str) -> str | None:
    """Why decode runs eagerly (a line for the log), or None when graphs are captured."""
    if disable:
        return "--disable-cuda-graph"
    if device_type not in DEVICE_TYPES:
        return f"not on CUDA ({device_type})"
    if backend not in GRAPH_BACKENDS:
        return f"the {backend} attention backend decodes eagerly (graphs need flashinfer)"
    return None


@dataclass
class PaddedDecode:
    """A decode batch padded to its bucket: request i < size is the batch's i-th request."""

    size: int  # real requests
    token_ids: list[int]
    positions: list[int]
    layout: BatchLayout


def pad_decode(
    token_ids: Sequence[int],
    prefix_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    bucket: int,
    page_size: int,
    scratch_page: int,
) -> PaddedDecode:
    """One new token per request at position prefix_len; padding rows are one-token requests
    (token 0 at position 0) whose only page is the scratch page."""
    n = len(token_ids)
    if not 1 <= n <= bucket or len(prefix_lens) != n or len(page_tables) != n:
        raise ValueError(f"{n} decode rows do not fit a bucket of {bucket}")
    pad = bucket - n
    return PaddedDecode(
        size=n,
        token_ids=list(token_ids) + [0] * pad,
        positions=list(prefix_lens) + [0] * pad,
        layout=BatchLayout(
            page_size,
            list(prefix_lens) + [0] * pad,
            [1] * bucket,
            [list(t) for t in page_tables] + [[scratch_page]] * pad,
        ),
    )


def is_graph_decode(extend_lens: Sequence[int], has_prompt_rows: bool) -> bool:
    """A step a graph can serve: every request decodes one token, no prompt is scored."""
    return bool(extend_lens) and not has_prompt_rows and all(e == 1 for e in extend_lens)


@runtime_checkable
class DecodeGraphAttention(Protocol):
    """An attention backend that plans a fixed-shape decode outside the graph."""

    def init_decode_graphs(self, buckets: Sequence[int], max_pages_per_seq: int) -> None:
        """Allocate the static buffers and per-bucket state graphs of these sizes read."""
        ...

    def prepare_decode_graph(self, layout: BatchLayout, bucket: int) -> AttentionMetadata:
        """Fill the bucket's static buffers for `layout` (padded to `bucket` requests) and
        return its metadata: the same object, reading the same buffers, at every call."""
        ...


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record `fn` (run once eagerly first); its output tensor is refilled by replay."""
        ...

    def replay(self) -> None: ...


class CudaGraph:
    """torch.cuda.CUDAGraph with torch's recipe: warm up on a side stream, then capture."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # lazy state (tables, kernels, cuBLAS handles) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], Graph]:
    """New CUDA graphs sharing one memory pool: the buckets' graphs never run at once."""
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


# Where a runner's graphs come from (tests swap in a stand-in to run the path on the CPU).
GRAPH_FACTORY: Callable[[], Callable[[], Graph]] = cuda_graph_factory


# (input ids, positions, metadata, sampled rows) -> logits [rows, vocab]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """The captured graphs of one runner and the static buffers they read and write."""

    def __init__(
        self,
        forward: ForwardFn,
        attn: DecodeGraphAttention,
        device: torch.device,
        max_bs: int,
        page_size: int,
        scratch_page: int,
        max_pages_per_seq: int,
    ) -> None:
        self.forward = forward
        self.attn = attn
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.buckets = batch_buckets(max_bs)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.rows = torch.arange(max_bs, dtype=torch.long, device=device)
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # for tests and logs: steps served by a graph
        attn.init_decode_graphs(self.buckets, max_pages_per_seq)

    def capture(self) -> None:
        make_graph = GRAPH_FACTORY()
        # Largest first: the smaller graphs then fit in the blocks the pool already holds.
        for b in reversed(self.buckets):
            # Captured on padding alone: what the graph reads is refilled before each replay.
            scratch = self.scratch_page
            padded = pad_decode([0], [0], [[scratch]], b, self.page_size, scratch)
            meta = self.attn.prepare_decode_graph(padded.layout, b)
            ids, pos, rows = self.input_ids[:b], self.positions[:b], self.rows[:b]
            ids.zero_()
            pos.zero_()

            def step(ids=ids, pos=pos, meta=meta, rows=rows) -> torch.Tensor:  # noqa: ANN001
                return self.forward(ids, pos, meta, rows)

            graph = make_graph()
            self.outputs[b] = graph.capture(step)
            self.graphs[b] = graph

    @classmethod
    def start(
        cls,
        forward: ForwardFn,
        attn: object,
        device: torch.device,
        max_bs: int,
        page_size: int,
        scratch_page: int,
        max_pages_per_seq: int,
    ) -> DecodeGraphs | None:
        """Capture every bucket; None (decode runs eagerly, said in the log) if that fails:
        e.g. a layer that syncs with the host, which a capture refuses."""
        assert isinstance(attn, DecodeGraphAttention)
        batch_buckets(max_bs)  # a bad --cuda-graph-max-bs is the user's error: refuse to start
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                graphs = cls(
                    forward, attn, device, max_bs, page_size, scratch_page, max_pages_per_seq
                )
                graphs.capture()
        except Exception as e:  # noqa: BLE001 (any failure: serve eagerly, say why)
            logger.warning("CUDA graphs off: capturing decode failed: %s", e)
            return None
        logger.info(
            "CUDA graphs: decode captured at batch sizes %s in %.1f s",
            graphs.buckets,
            time.perf_counter() - t0,
        )
        return graphs

    def bucket(self, batch_size: int) -> int | None:
        return bucket_for(batch_size, self.buckets)

    def run(
        self,
        token_ids: Sequence[int],
        prefix_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Logits [len(token_ids), vocab] of one decode step, by replay (a view of the static
        output: valid until the next replay)."""
        b = self.bucket(len(token_ids))
        assert b is not None, "the caller checks the batch fits"
        padded = pad_decode(
            token_ids, prefix_lens, page_tables, b, self.page_size, self.scratch_page
        )
        host = np.asarray([padded.token_ids, padded.positions], dtype=np.int64)
        self.input_ids[:b].copy_(torch.from_numpy(host[0]))
        self.positions[:b].copy_(torch.from_numpy(host[1]))
        self.attn.prepare_decode_graph(padded.layout, b)
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b][: padded.size]
