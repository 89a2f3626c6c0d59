"""The device side of a step: weights, KV pool, attention metadata, forward and sampling."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minisgl.config import EngineArgs
from minisgl.engine.memory import default_num_pages
from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers.attention import create_attention_backend
from minisgl.layers.attention.base import BatchLayout
from minisgl.layers.sampling import SamplingBatch, sample
from minisgl.models.config import ModelConfig
from minisgl.models.loader import load_model, resolve_device, resolve_dtype
from minisgl.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ForwardInput:
    """One step, as plain lists: the scheduler's batch flattened in request order."""

    token_ids: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    page_tables: list[list[int]]
    sample_rows: list[int]  # index of each sampled request within the batch
    sample_params: list[SamplingParams]
    sample_steps: list[int]
    sample_seeds: list[int]
    # int32 token bitmask [len(sample_rows), words] for structured outputs; None: no row is
    # constrained (the common case costs nothing).
    grammar_bitmask: Any = None
    grammar_rows: list[int] | None = None  # which rows of the bitmask are constrained


class ModelRunner:
    def __init__(
        self,
        args: EngineArgs,
        model_path: Path,
        config: ModelConfig,
        max_seq_len: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.config = config
        self.page_size = args.page_size
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, config, self.device)
        self.model = load_model(
            model_path,
            config,
            self.dtype,
            self.device,
            tp_rank,
            tp_size,
            cpu_kernel_tuning=args.cpu_kernel_tuning,
        )
        num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        num_heads = config.num_attention_heads // tp_size
        bytes_per_page = KVPool.bytes_per_page(
            config.num_hidden_layers, self.page_size, num_kv_heads, config.head_dim, self.dtype
        )
        self.num_pages = args.num_pages or default_num_pages(
            bytes_per_page=bytes_per_page,
            page_size=self.page_size,
            max_seq_len=max_seq_len,
            max_running_requests=args.max_running_requests,
            memory_fraction=args.memory_fraction,
            device=self.device,
        )
        self.kv_pool = KVPool(
            config.num_hidden_layers,
            self.num_pages,
            self.page_size,
            num_kv_heads,
            config.head_dim,
            self.dtype,
            self.device,
        )
        self.attn = create_attention_backend(
            args.attention_backend,
            kv_pool=self.kv_pool,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=config.head_dim,
            scale=config.head_dim**-0.5,
        )
        logger.info(
            "KV cache: %d pages x %d tokens (%.1f MiB), dtype %s on %s",
            self.num_pages,
            self.page_size,
            self.num_pages * bytes_per_page / 2**20,
            self.dtype,
            self.device,
        )

    @torch.inference_mode()
    def forward(self, inp: ForwardInput) -> list[int]:
        """Run one batch; returns the sampled token of every request in `sample_rows`."""
        layout = BatchLayout(self.page_size, inp.prefix_lens, inp.extend_lens, inp.page_tables)
        meta = self.attn.prepare(layout)
        positions = np.concatenate(
            [np.arange(p, p + n, dtype=np.int64) for p, n in zip(inp.prefix_lens, inp.extend_lens)]
        )
        ends = np.cumsum(np.asarray(inp.extend_lens, dtype=np.int64)) - 1
        input_ids = torch.tensor(inp.token_ids, dtype=torch.long, device=self.device)
        pos_t = torch.from_numpy(positions).to(self.device)
        sample_idx = torch.from_numpy(ends[inp.sample_rows]).to(self.device)
        logits = self.model(input_ids, pos_t, self.attn, meta, sample_idx)
        if not inp.sample_rows:
            return []
        if inp.grammar_rows:
            apply_grammar_mask(logits, inp.grammar_bitmask, inp.grammar_rows)
        batch = SamplingBatch.build(
            inp.sample_params, inp.sample_steps, inp.sample_seeds, self.device
        )
        return sample(logits, batch).tolist()


def apply_grammar_mask(logits: torch.Tensor, bitmask: Any, rows: list[int]) -> None:
    """Structured outputs: disallowed tokens of the constrained rows to -inf, in place."""
    from minisgl.structured.grammar import apply_bitmask

    apply_bitmask(logits, bitmask, rows)
