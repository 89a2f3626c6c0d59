"""API server -> tokenizer worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.message.codec import register
from minisgl.sampling_params import SamplingParams


@register("tokenize")
@dataclass
class TokenizeRequest:
    """One generation request. Exactly one of messages / prompt_text / prompt_ids is set."""

    rid: str
    arrival_time: float  # time.time() at the API server; queue time is measured from it
    params: SamplingParams
    max_tokens: int | None  # None: whatever context is left after the prompt
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the chat template
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI tool definitions for the template
    # chat: end the prompt with the assistant's turn header (False: continue_final_message)
    add_generation_prompt: bool = True
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    skip_special_tokens: bool = True
    echo: bool = False  # the reply starts with the prompt's text (decoded: an ids prompt)
    # Special tokens kept in the text even when skipping them: the tags the parsers read.
    keep_special: list[str] = field(default_factory=list)
    # The API server held other generation requests, not yet sent on, when it sent this one
    # (a burst): the scheduler waits for them before its next step instead of prefilling apart.
    more: bool = False


@register("abort")
@dataclass
class AbortRequest:
    """Drop a request (client gone, stop string hit, drain timeout). Unknown rids are ignored."""

    rid: str
    index: int | None = None  # one sample of an n > 1 request (a stop string hit); None: all


@register("ping")
@dataclass
class Ping:
    """Goes round every worker and back to the API server; each stage appends its name."""

    ping_id: int
    hops: list[str] = field(default_factory=list)


@register("heartbeat")
@dataclass
class Heartbeat:
    """API server -> tokenizer -> straight back: the tokenizer's loop is turning (/health)."""

    beat_id: int


@register("tokenize_only")
@dataclass
class TokenizeOnly:
    """POST /tokenize: a prompt or chat messages -> ids, answered with a TokenizerReply."""

    rid: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


@register("detokenize_only")
@dataclass
class DetokenizeOnly:
    """POST /detokenize: ids -> text, answered with a TokenizerReply."""

    rid: str
    tokens: list[int]


KINDS: tuple[type, ...] = (
    TokenizeRequest,
    AbortRequest,
    Ping,
    Heartbeat,
    TokenizeOnly,
    DetokenizeOnly,
)
