"""OpenAI wire format (the subset minisgl serves), as pydantic models.

Requests are validated here; every violation becomes a 400 with an OpenAI error body. Unknown
fields are ignored (as vLLM and SGLang do), except features we cannot honour, which are
rejected explicitly rather than silently dropped.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Integers travel to the workers as msgpack (64-bit at most); far below that, no context or
# vocabulary is this large (INT_MAX), so anything beyond is a 400 here rather than an encoding
# error. SamplingParams checks the same bounds, offline too.
from minisgl.sampling_params import (
    INT_MAX,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    SEED_MAX,
)

MAX_STOP = 64


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk too


class TextPart(_Request):
    type: Literal["text"]
    text: str


# ---- tool calling (chat) ----
class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class CalledFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


# ---- structured outputs ----
class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None  # structural_tag (xgrammar's format object)


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool results
    reasoning_content: str | None = None  # assistant turns (Qwen3 keeps the last one's)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined, developer -> system)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class SamplingFields(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None  # a single-model server answers whatever model is named
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    max_tokens: int | None = Field(None, ge=1, le=INT_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT_MAX)
    n: int = Field(1, ge=1, le=INT_MAX)  # and at most the server's --max-n
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY)  # vLLM/SGLang extra
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM extra: answered with a 400 (use echo + logprobs)
    # No EOS / stop_token_ids / stop string ends the reply before this many tokens: vLLM's
    # min_tokens, SGLang's min_new_tokens (either; both must then agree).
    min_tokens: int | None = Field(None, ge=0, le=INT_MAX)
    min_new_tokens: int | None = Field(None, ge=0, le=INT_MAX)
    # vLLM extras that change what is generated and that minisgl does not implement: read so
    # that a value other than vLLM's default is refused, not served as if absent.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    use_beam_search: bool = False
    truncate_prompt_tokens: int | None = None  # -1 (vLLM: the context length) changes nothing
    return_tokens_as_token_ids: bool = False
    user: str | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored
    # Structured outputs: OpenAI's response_format, SGLang's regex/ebnf, vLLM's guided_*.
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    @field_validator(
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        mode="before",  # ahead of the bounds, which a NaN fails with a message about them
    )
    @classmethod
    def _finite(cls, v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().isdigit() or int(key) > INT_MAX:
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"biases must be in [-100, 100], got {bias}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a feature this server does not implement."""
        if self.prompt_logprobs is not None:
            return (
                "prompt_logprobs",
                "prompt_logprobs is not supported: use /v1/completions with echo and logprobs",
            )
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if None not in (self.min_tokens, self.min_new_tokens) and (
            self.min_tokens != self.min_new_tokens
        ):
            return (
                "min_new_tokens",
                f"min_tokens ({self.min_tokens}) and min_new_tokens ({self.min_new_tokens}) "
                "are the same setting (vLLM's and SGLang's names): give one",
            )
        for name, used in (
            ("bad_words", bool(self.bad_words)),
            ("allowed_token_ids", self.allowed_token_ids is not None),
            ("use_beam_search", self.use_beam_search),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens not in (None, -1)),
            ("return_tokens_as_token_ids", self.return_tokens_as_token_ids),
        ):
            if used:
                return name, f"{name} is not supported"
        return None

    def num_logprobs(self) -> int | None:
        """Top alternatives per generated token, or None when logprobs are off."""
        return None

    def least_tokens(self) -> int:
        """min_tokens, or min_new_tokens (0 when neither is given)."""
        given = self.min_tokens if self.min_tokens is not None else self.min_new_tokens
        return given or 0

    def limit_text(self) -> str:
        """The field that set limit() and its value (for messages)."""
        return f"max_tokens ({self.max_tokens})"

    def num_prompt_logprobs(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class _Templated(_Request):
    """The chat template inputs a request may give (vLLM's fields)."""

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    # The prompt ends with a new assistant turn's header (default), or goes on from the last
    # message, an assistant's (continue_final_message: a prefill the model continues).
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def template_kwargs(self) -> dict[str, Any]:
        """The template's kwargs, a top-level chat_template folded in."""
        kwargs = dict(self.chat_template_kwargs)
        if self.chat_template is not None:
            kwargs.setdefault("chat_template", self.chat_template)
        return kwargs


class ChatCompletionRequest(SamplingFields, _Templated):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI fields this server cannot honour: read, so that they are refused, not dropped.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    # Bookkeeping or hints with no effect on a self-hosted model: accepted and ignored.
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None

    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's chat echo (repeat the last message): not implemented

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions is not None or self.function_call is not None:
            name = "functions" if self.functions is not None else "function_call"
            return name, f"{name} is deprecated and not supported: use tools and tool_choice"
        if self.audio is not None or any(m != "text" for m in self.modalities or []):
            return "modalities", "only text output is supported"
        if self.prediction is not None:
            return "prediction", "predicted outputs are not supported"
        if self.web_search_options is not None:
            return "web_search_options", "web search is not supported"
        if self.echo:
            return "echo", "echo is only supported on /v1/completions"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def limit_text(self) -> str:
        name = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return f"{name} ({self.limit()})"

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # 0 is allowed with echo (score the prompt, generate nothing: evaluation harnesses).
    max_tokens: int | None = Field(None, ge=0, le=INT_MAX)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request (a batch, or one); ValueError when there are none."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return [x if isinstance(x, str) else list(x) for x in p]  # type: ignore[arg-type]

    def limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default

    def limit_text(self) -> str:
        if self.max_completion_tokens is not None:
            return f"max_completion_tokens ({self.max_completion_tokens})"
        if self.max_tokens is None:
            return f"max_tokens ({self.limit()}, the default)"
        return f"max_tokens ({self.max_tokens})"

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        if not self.echo:
            return None
        if self.logprobs is None and self.max_tokens == 0:
            return 0  # nothing generated: the prompt's pass is the request (scores unused)
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 is only allowed with echo"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported"
        return super().unsupported()


# ---- responses (non-streaming; stream chunks are built as plain dicts on the hot path) ----
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minisgl"
    root: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- POST /tokenize and /detokenize (vLLM's shapes) ----
class TokenizeBody(_Templated):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False
    tools: list[ToolDef] | None = None


class DetokenizeBody(_Request):
    model: str | None = None
    tokens: list[int]
