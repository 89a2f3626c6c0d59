"""Per-request sampling parameters (torch-free: shared by the API, the scheduler and the engine)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this sample greedily (as in vLLM): dividing logits by a smaller one
# overflows float32 and leaves no distribution to draw from.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI (top_logprobs <= 20) and vLLM
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: biases in [-100, 100]; -100 bans a token in practice
# The server's request bounds (minisgl.server.protocol takes them from here).
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
INT_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("top_k", "seed", "max_tokens", "min_tokens", "n", "logprobs", "prompt_logprobs")
_OPTIONAL_INT_FIELDS = frozenset({"seed", "logprobs", "prompt_logprobs"})


def _number(name: str, value: Any) -> float:
    """A finite real number (an int or a float; a bool or a string is refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return v


def _integer(name: str, value: Any) -> int:
    """An integer: an int, or a float with no fraction (JSON's 2.0), as the server takes it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    v = float(value)
    if not (math.isfinite(v) and v.is_integer()):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(v)


def _token_key(key: Any) -> int:
    """A logit_bias key: a token id, or its decimal string (JSON object keys are strings)."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if isinstance(key, bool) or not isinstance(key, numbers.Integral):
        raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}")
    return int(key)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16  # 0 only with prompt_logprobs: score the prompt, generate nothing
    # vLLM's min_tokens (SGLang's min_new_tokens): until this many tokens are generated, the
    # EOS token(s) and stop_token_ids cannot be sampled and stop strings are not matched.
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Keep the stop string, or the stop/EOS token's text, at the end of the output (vLLM's).
    include_stop_str_in_output: bool = False
    # Structured output: a grammar the tokens must follow (minisgl.structured.spec kinds:
    # json_schema, json_object, regex, ebnf, choice, structural_tag) and its text.
    grammar_kind: str | None = None
    grammar: str | None = None
    # Samples per prompt: prefilled once, sample i seeded with seed + i (as vLLM).
    n: int = 1
    # Log-probabilities (log-softmax of the raw logits): None = off; k = the chosen token's
    # plus the k most likely alternatives, for each generated token / each prompt token.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # OpenAI penalties over the generated tokens; HF/vLLM repetition penalty over prompt and
    # output (> 1 discourages repeats); bias added to the logits of token ids (-100 bans).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The types first, as the server's request model checks them: a number where a
        # number goes (2.0 is the integer 2, as in JSON; 2.5, "2", True are refused).
        for name in _FLOAT_FIELDS:
            setattr(self, name, _number(name, getattr(self, name)))
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL_INT_FIELDS:
                setattr(self, name, _integer(name, value))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop_token_ids = [_integer("stop_token_ids", t) for t in (self.stop_token_ids or [])]
        # JSON (and msgpack from JSON) keys are strings: token ids as ints from here on.
        self.logit_bias = {
            _token_key(k): _number("logit_bias", v) for k, v in (self.logit_bias or {}).items()
        }
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for out-of-range values (the server's
        request bounds: what it accepts is accepted here)."""
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= INT_MAX:
            raise ValueError(f"top_k must be -1 (disabled) or in [0, {INT_MAX}], got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if self.max_tokens > INT_MAX:
            raise ValueError(f"max_tokens must be at most {INT_MAX}, got {self.max_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(
                f"max_tokens must be >= 1 (0 only when scoring the prompt), got {self.max_tokens}"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens], got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if (self.grammar_kind is None) != (self.grammar is None):
            raise ValueError("grammar_kind and grammar are set together")
        if not 1 <= self.n <= INT_MAX:
            raise ValueError(f"n must be in [1, {INT_MAX}], got {self.n}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty}"
            )
        for tok, bias in self.logit_bias.items():
            if tok < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {tok}")
            if not (math.isfinite(bias) and abs(bias) <= LOGIT_BIAS_LIMIT):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must adjust this request's logits before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def sample_params(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of n: one sample each, its own seed. Only sample 0
        scores the prompt (the others share its prompt logprobs), unless nothing is generated."""
        seed = None if self.seed is None else (self.seed + index) % (1 << 63)
        keep_prompt = index == 0 or self.max_tokens == 0
        prompt_logprobs = self.prompt_logprobs if keep_prompt else None
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
