"""One generation request as the scheduler tracks it (torch-free)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from minisgl.logprobs import TokenLogprobs
from minisgl.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minisgl.kvcache.radix_cache import RadixNode

FINISH_REASONS = ("stop", "length", "abort")


class Request:
    """State of one request: its tokens, its KV pages and how far the KV is computed.

    `page_table[:num_cached_pages]` are pages owned by the radix cache (shared, pinned by a lock
    on `cache_node` while the request lives); the rest are the request's own. Times use
    `time.time()` (wall clock, as the engine and the metrics use); pass `arrival_time` from it.
    """

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        group: str | None = None,
        index: int = 0,
    ) -> None:
        self.rid = rid  # unique among live requests: "<group>#<index>" for a sample of n > 1
        self.group = rid if group is None else group  # the user's request id
        self.index = index  # which of its n samples this is
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.output_ids: list[int] = []
        self.page_table: list[int] = []
        self.num_computed = 0  # tokens of all_ids whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.seed: int | None = params.seed  # the engine may overwrite it
        self.grammar: Any = None  # structured output: the xgrammar matcher (engine-owned)
        self.status = "new"  # new -> waiting -> running -> (waiting on preemption) -> finished
        # Scheduler internals.
        self.num_cached_pages = 0  # leading pages of page_table owned by the radix cache
        self.cache_node: RadixNode | None = None  # locked radix node covering those pages
        self.prefill_target = 0  # num_tokens at admission: sampling there ends the prefill
        self.first_admit_time: float | None = None
        self.finish_time: float | None = None
        # Sampling state. Penalty counts on the device (owned by the model runner).
        self.penalty_state: Any = None
        # Prompt scoring: one entry per prompt token scored so far (the first is None: nothing
        # predicts it), sent with the request's first output.
        self.prompt_logprobs: TokenLogprobs | None = None
        if params.prompt_logprobs is not None and self.prompt_ids:
            self.prompt_logprobs = TokenLogprobs()
            self.prompt_logprobs.append(self.prompt_ids[0], None, [], [])
        self.prompt_logprobs_sent = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_reusable(self) -> int:
        """Leading tokens whose KV the prefix cache may serve at admission: all but the last
        (its logits are sampled), and no prompt position not scored yet when the prompt's
        logprobs are asked (token p's logprob comes from position p - 1's logits)."""
        if self.prompt_logprobs is None:
            return self.num_tokens - 1
        return min(self.num_tokens - 1, max(0, len(self.prompt_logprobs) - 1))

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_remaining(self) -> int:
        """Tokens whose KV is still to compute before the next sample."""
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (decode steps ask for one token)."""
        np_ = len(self.prompt_ids)
        if start >= np_:
            return self.output_ids[start - np_ : end - np_]
        if end <= np_:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - np_]

    def __repr__(self) -> str:
        return (
            f"Request({self.rid!r}, status={self.status}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, pages={len(self.page_table)}, "
            f"finish={self.finish_reason})"
        )
