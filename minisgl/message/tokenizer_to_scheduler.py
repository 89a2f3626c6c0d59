"""Tokenizer worker -> scheduler worker (the detokenizer also sends AbortRequest here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.message.api_to_tokenizer import AbortRequest, Ping
from minisgl.message.codec import register
from minisgl.sampling_params import SamplingParams


@register("tokenized")
@dataclass
class TokenizedRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int | None  # None: fill the context
    arrival_time: float
    skip_special_tokens: bool = True
    echo: bool = False
    keep_special: list[str] = field(default_factory=list)  # see TokenizeRequest
    more: bool = False  # more requests on their way right behind this one (see TokenizeRequest)


KINDS: tuple[type, ...] = (TokenizedRequest, AbortRequest, Ping)
__all__ = ["KINDS", "AbortRequest", "Ping", "TokenizedRequest"]
