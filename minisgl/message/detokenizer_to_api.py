"""Detokenizer worker -> API server (the tokenizer also sends ErrorReply, TokenizerReply and
Heartbeat answers here)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.message.api_to_tokenizer import Heartbeat, Ping
from minisgl.message.codec import register
from minisgl.message.scheduler_to_detokenizer import SchedulerStatsUpdate


@register("logprobs_text")
@dataclass
class LogprobsText:
    """Log-probabilities with each token's text and bytes (the OpenAI shapes need both)."""

    tokens: list[str]
    token_bytes: list[bytes]
    logprobs: list[float | None]
    top_tokens: list[list[str]]
    top_bytes: list[list[bytes]]
    top_logprobs: list[list[float]]


@register("text_out")
@dataclass
class TextOutput:
    """New complete text of one request. The one with finished=True is its final reply."""

    rid: str
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_time: float | None = None
    index: int = 0  # which sample of an n > 1 request; each sample ends with finished=True
    logprobs: LogprobsText | None = None  # of the tokens behind this output, when asked
    prompt_logprobs: LogprobsText | None = None  # of every prompt token, on the first output
    prompt_text: str | None = None  # echo of an ids prompt, on the first output


@register("text_batch")
@dataclass
class TextBatch:
    outputs: list[TextOutput]


@register("error_reply")
@dataclass
class ErrorReply:
    """Final reply for a request that could not be served (bad input the API could not see)."""

    rid: str
    message: str
    status: int = 400
    param: str | None = None


@register("accepted")
@dataclass
class RequestAccepted:
    """The engine took the request (its prompt and grammar passed): no ErrorReply for bad input
    comes after this. Sent before any of its outputs."""

    rid: str


@register("tokenizer_reply")
@dataclass
class TokenizerReply:
    """The tokenizer worker's answer to TokenizeOnly (tokens) or DetokenizeOnly (text)."""

    rid: str
    tokens: list[int] | None = None
    token_strs: list[str] | None = None
    text: str | None = None


KINDS: tuple[type, ...] = (
    TextBatch,
    ErrorReply,
    RequestAccepted,
    SchedulerStatsUpdate,
    Ping,
    Heartbeat,
    TokenizerReply,
)
