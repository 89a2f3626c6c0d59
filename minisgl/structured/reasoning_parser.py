"""Qwen3's reasoning format: `<think>...</think>` before the answer, split into two fields.

The rule is the same for a whole text and for a stream, so a stream reassembles to the
non-streaming answer: the output is reasoning when it opens with `<think>` (or when the prompt
already opened the block), up to `</think>` or the end; the rest, leading blank lines dropped,
is the answer. An output that does not open a think block (`enable_thinking: false` pre-fills
an empty one in the prompt) is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.structured.holdback import partial_marker_len

THINK_START = "<think>"
THINK_END = "</think>"
PARSERS = ("qwen3",)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class Qwen3ReasoningParser:
    """Incremental splitter; `feed` chunks, then `finish` once. Whole texts: `split`."""

    def __init__(self, started: bool = False) -> None:
        # "start": deciding whether the output opens a think block; "think"; "answer".
        self.state = "think" if started else "start"
        self.buffer = ""
        self.strip_leading = started  # drop blank lines right after </think>

    def feed(self, text: str) -> ReasoningDelta:
        self.buffer += text
        out = ReasoningDelta()
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(THINK_START):
                    self.buffer = head[len(THINK_START) :]
                    self.state = "think"
                    continue
                if THINK_START.startswith(head):
                    return out  # nothing yet, or maybe the beginning of <think>: wait
                self.state = "answer"
                self.strip_leading = False
                continue
            if self.state == "think":
                end = self.buffer.find(THINK_END)
                if end >= 0:
                    out.reasoning += self.buffer[:end]
                    self.buffer = self.buffer[end + len(THINK_END) :]
                    self.state = "answer"
                    self.strip_leading = True
                    continue
                keep = partial_marker_len(self.buffer, (THINK_END,))
                cut = len(self.buffer) - keep
                out.reasoning += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                return out
            # answer
            if self.strip_leading:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return out
                self.strip_leading = False
            out.content += self.buffer
            self.buffer = ""
            return out

    def finish(self) -> ReasoningDelta:
        """Whatever was held back waiting for a marker that never came."""
        rest, self.buffer = self.buffer, ""
        if self.state == "think":
            return ReasoningDelta(reasoning=rest)
        if self.state == "answer" and self.strip_leading:
            rest = rest.lstrip()
        return ReasoningDelta(content=rest)

    @classmethod
    def split(cls, text: str, started: bool = False) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        parser = cls(started)
        a, b = parser.feed(text), parser.finish()
        return a.reasoning + b.reasoning, a.content + b.content
