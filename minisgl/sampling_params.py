"""Per-request sampling parameters (torch-free: shared by the API, the scheduler and the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this sample greedily (as in vLLM): dividing logits by a smaller one
# overflows float32 and leaves no distribution to draw from.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Keep the stop string, or the stop/EOS token's text, at the end of the output (vLLM's).
    include_stop_str_in_output: bool = False
    # Structured output: a grammar the tokens must follow (minisgl.structured.spec kinds:
    # json_schema, json_object, regex, ebnf, choice, structural_tag) and its text.
    grammar_kind: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
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
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if (self.grammar_kind is None) != (self.grammar is None):
            raise ValueError("grammar_kind and grammar are set together")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
