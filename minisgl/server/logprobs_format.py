"""Log-probabilities in the OpenAI wire shapes, from the detokenizer's `LogprobsText`.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}`. Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`, where text_offset is each token's character offset in the choice's text (the
echoed prompt included) and a prompt's first token has null logprobs (nothing predicts it).
"""

from __future__ import annotations

from typing import Any

from minisgl.message.detokenizer_to_api import LogprobsText

FLOOR = -9999.0  # JSON has no -inf (vLLM clamps the same way)


def _lp(value: float | None) -> float | None:
    return None if value is None else max(value, FLOOR)


def chat_content(lt: LogprobsText) -> list[dict[str, Any]]:
    out = []
    for i, token in enumerate(lt.tokens):
        tops = [
            {"token": t, "logprob": _lp(v), "bytes": list(b)}
            for t, v, b in zip(lt.top_tokens[i], lt.top_logprobs[i], lt.top_bytes[i], strict=True)
        ]
        entry = {
            "token": token,
            "logprob": _lp(lt.logprobs[i]),
            "bytes": list(lt.token_bytes[i]),
            "top_logprobs": tops,
        }
        out.append(entry)
    return out


class CompletionLogprobs:
    """The legacy completions shape for one choice, built incrementally (streams carry the
    entries of each chunk; text_offset keeps counting across chunks)."""

    def __init__(self) -> None:
        self.offset = 0  # characters of the choice's tokens so far

    def part(self, lt: LogprobsText, prompt: bool = False) -> dict[str, Any]:
        offsets = []
        tops: list[dict[str, float] | None] = []
        for i, token in enumerate(lt.tokens):
            offsets.append(self.offset)
            self.offset += len(token)
            if prompt and lt.logprobs[i] is None:
                tops.append(None)
                continue
            tops.append(
                {t: _lp(v) for t, v in zip(lt.top_tokens[i], lt.top_logprobs[i], strict=True)}  # type: ignore[misc]
            )
        return {
            "tokens": list(lt.tokens),
            "token_logprobs": [_lp(v) for v in lt.logprobs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def merge_completion(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One choice's chunks of the legacy shape, joined."""
    if not parts:
        return None
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for p in parts for v in p[k]] for k in keys}
