"""Scheduler worker -> detokenizer worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.logprobs import TokenLogprobs
from minisgl.message.api_to_tokenizer import Ping
from minisgl.message.codec import register


@register("registered")
@dataclass
class RequestRegistered:
    """Sent once the engine accepted a request, before any of its tokens (same socket: ordered)."""

    rid: str
    stop: list[str]
    hidden_token_ids: list[int]  # EOS / stop_token_ids: counted as tokens, never shown as text
    skip_special_tokens: bool
    prompt_tokens: int
    include_stop_str_in_output: bool = False
    n: int = 1  # samples: outputs carry their index
    echo_ids: list[int] | None = None  # prompt ids whose text the first reply carries
    keep_special: list[str] = field(default_factory=list)  # see TokenizeRequest
    min_tokens: int = 0  # stop strings are not matched in the first min_tokens tokens' text


@register("token_out")
@dataclass
class TokenOutput:
    rid: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_time: float | None = None
    index: int = 0  # which sample
    logprobs: TokenLogprobs | None = None  # of token_ids, when asked
    prompt_logprobs: TokenLogprobs | None = None  # of every prompt token, once


@register("token_batch")
@dataclass
class TokenBatch:
    """All outputs of one engine step: one message per step, not per request."""

    outputs: list[TokenOutput]


@register("ended")
@dataclass
class RequestEnded:
    """The scheduler dropped a request: "abort" (asked to) or "error" (rejected; see message)."""

    rid: str
    reason: str
    message: str = ""
    status: int = 400
    param: str | None = None
    index: int | None = None  # an abort of one sample only; None: the whole request


@register("sched_stats")
@dataclass
class SchedulerStatsUpdate:
    stats: dict[str, Any]  # SchedulerStats fields
    batch_sizes: list[int] = field(default_factory=list)  # one per step since the last update
    time: float = 0.0
    # Speculative decoding: verifies since the last update, by drafts kept (index = kept).
    accept_lengths: list[int] = field(default_factory=list)


KINDS: tuple[type, ...] = (RequestRegistered, TokenBatch, RequestEnded, SchedulerStatsUpdate, Ping)
