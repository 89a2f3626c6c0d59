"""Log-probabilities as they travel from the engine to the user (torch-free, compact).

Ids and floats only: the detokenizer turns ids into token strings, the API server into the
OpenAI shapes. One entry per token: the token's own log-probability (None for a prompt's first
token, which nothing predicts) and its `k` most likely alternatives, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def append(
        self, token: int, logprob: float | None, top_ids: list[int], top_lps: list[float]
    ) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.top_ids.append(top_ids)
        self.top_logprobs.append(top_lps)

    def extend(self, other: TokenLogprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def head(self, n: int) -> TokenLogprobs:
        """The first n tokens' entries (a run of accepted drafts cut where the request ended)."""
        return TokenLogprobs(
            self.token_ids[:n], self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n]
        )

    def rows(self) -> list[TokenLogprobs]:
        """One TokenLogprobs per token."""
        return [
            TokenLogprobs([t], [lp], [ids], [lps])
            for t, lp, ids, lps in zip(
                self.token_ids, self.logprobs, self.top_ids, self.top_logprobs, strict=True
            )
        ]
