"""Per-request sampling parameters (torch-free: shared by the API, the scheduler and the engine)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# Temperatures below this sample greedily (as in vLLM): dividing logits by a smaller one
# overflows float32 and leaves no distribution to draw from.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI (top_logprobs <= 20) and vLLM
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: biases in [-100, 100]; -100 bans a token in practice


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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        # JSON (and msgpack from JSON) keys are strings: token ids as ints from here on.
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for out-of-range values."""
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
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
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
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
