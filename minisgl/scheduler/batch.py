"""What the scheduler hands the engine for one step (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.scheduler.request import Request


@dataclass
class ScheduledSeq:
    req: Request
    start: int  # req.num_computed before this step: KV of all_ids[:start] is in the cache
    token_ids: list[int]  # all_ids[start : start + n], n >= 1: the tokens this step computes
    sample: bool  # this step reaches the end of all_ids, so a next token is sampled
    # Pages covering all_ids[: start + n], snapshot at schedule time (the request's own list may
    # change between steps, when prefix-cache deduplication swaps in shared pages).
    page_table: list[int] = field(default_factory=list)
    is_decode: bool = False  # one generated token after the prefill; False: a prefill chunk
    # Speculative decoding: draft tokens appended to a decode's token (the tail of token_ids),
    # scored in the same forward; their KV slots beyond what is accepted are given back.
    draft_ids: list[int] = field(default_factory=list)

    @property
    def extend_len(self) -> int:
        return len(self.token_ids)


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq]
    page_size: int

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_decode(self) -> int:
        return sum(1 for s in self.seqs if s.is_decode)

    @property
    def num_prefill(self) -> int:
        return sum(1 for s in self.seqs if not s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs if not s.is_decode)

    @property
    def num_samples(self) -> int:
        return sum(1 for s in self.seqs if s.sample)

    def layout_lists(self) -> tuple[list[int], list[int], list[list[int]]]:
        """(prefix_lens, extend_lens, page_tables) per seq, in batch order."""
        prefix_lens = [s.start for s in self.seqs]
        extend_lens = [len(s.token_ids) for s in self.seqs]
        page_tables = [list(s.page_table) for s in self.seqs]
        return prefix_lens, extend_lens, page_tables

    def to_layout(self) -> Any:
        """The attention `BatchLayout` (imported lazily: that module may need torch)."""
        from minisgl.layers.attention.base import BatchLayout

        prefix_lens, extend_lens, page_tables = self.layout_lists()
        return BatchLayout(
            page_size=self.page_size,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            page_tables=page_tables,
        )
