"""The n choices of one request as replies arrive: text, logprobs, echo, finish reasons.

One `TextOutput` belongs to one sample (its `index`); each sample ends with its own finished
output, and the request is complete when all n have. The prompt's echo (completions) and
its logprobs arrive once, on the request's first output, before any other sample's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.message.detokenizer_to_api import LogprobsText, TextOutput
from minisgl.server.logprobs_format import CompletionLogprobs, chat_content, merge_completion


@dataclass
class Choice:
    index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # chat entries / completion parts
    finish_reason: str | None = None
    started: bool = False  # its first output was seen (the echo goes before it)
    completion_lp: CompletionLogprobs = field(default_factory=CompletionLogprobs)


class Choices:
    def __init__(
        self, kind: str, n: int, logprobs: bool, echo: bool, prompt_text: str | None
    ) -> None:
        self.kind = kind
        self.want_logprobs = logprobs
        self.echo = echo
        self.prompt_text = prompt_text  # None for an ids prompt until the detokenizer sends it
        self.prompt_logprobs: LogprobsText | None = None
        self.choices = [Choice(i) for i in range(n)]

    @property
    def all_done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def add(self, out: TextOutput) -> tuple[str, Any]:
        """Record one output; returns the (text, logprobs) that a stream chunk carries now
        (logprobs in the endpoint's shape, or None)."""
        if out.prompt_text is not None:
            self.prompt_text = out.prompt_text
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        choice = self.choices[out.index]
        text = out.text
        lp_parts: list[Any] = []
        if not choice.started:
            choice.started = True
            if self.echo:
                text = (self.prompt_text or "") + text
                if self.want_logprobs and self.prompt_logprobs is not None:
                    lp_parts.append(choice.completion_lp.part(self.prompt_logprobs, prompt=True))
        if out.logprobs is not None and self.want_logprobs:
            if self.kind == "chat":
                lp_parts.extend(chat_content(out.logprobs))
            else:
                lp_parts.append(choice.completion_lp.part(out.logprobs))
        choice.parts.append(text)
        choice.logprobs.extend(lp_parts)
        if out.finished:
            choice.finish_reason = out.finish_reason or "stop"
        return text, self._shape(lp_parts) if lp_parts or self._empty_lp(out) else None

    def _empty_lp(self, out: TextOutput) -> bool:
        return self.want_logprobs and out.logprobs is not None

    def _shape(self, parts: list[Any]) -> dict[str, Any] | None:
        if self.kind == "chat":
            return {"content": parts}
        return merge_completion(parts)

    def body_choices(self) -> list[dict[str, Any]]:
        """The `choices` of a non-streaming response."""
        out = []
        for c in self.choices:
            text = "".join(c.parts)
            lp = self._shape(c.logprobs) if self.want_logprobs else None
            if self.want_logprobs and lp is None:
                lp = merge_completion([CompletionLogprobs().part(_EMPTY)])
            entry: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
            if self.kind == "chat":
                entry["message"] = {"role": "assistant", "content": text}
            else:
                entry["text"] = text
            entry["logprobs"] = lp
            out.append(entry)
        return out


_EMPTY = LogprobsText([], [], [], [], [], [])
