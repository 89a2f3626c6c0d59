"""A chat completion's text -> OpenAI message fields: reasoning_content, content, tool_calls.

The reasoning parser runs first (tool calls are never parsed out of the reasoning), then the
tool-call parser on the answer. Streaming and whole texts go through the same parsers, so the
deltas of a stream reassemble to the non-streaming message.
"""

from __future__ import annotations

from typing import Any

from minisgl.structured.reasoning_parser import Qwen3ReasoningParser
from minisgl.structured.tool_parser import Qwen3ToolParser, ToolCall


class ChatOutput:
    def __init__(self, *, reasoning: bool, tools: bool) -> None:
        self.reasoning = Qwen3ReasoningParser() if reasoning else None
        self.tools = Qwen3ToolParser() if tools else None

    def fresh(self) -> ChatOutput:
        """A parser pair like this one with no state yet (one per choice)."""
        return ChatOutput(reasoning=self.reasoning is not None, tools=self.tools is not None)

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The stream deltas (`delta` objects) for a new piece of text."""
        return self._deltas(text, final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas("", final=True)

    def _deltas(self, text: str, *, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        answer = text
        if self.reasoning is not None:
            part = self.reasoning.finish() if final else self.reasoning.feed(text)
            if part.reasoning:
                out.append({"reasoning_content": part.reasoning})
            answer = part.content
        if self.tools is None:
            if answer:
                out.append({"content": answer})
            return out
        parts = [self.tools.feed(answer)] if answer else []
        if final:
            parts.append(self.tools.finish())
        for piece in parts:
            if piece.content:
                out.append({"content": piece.content})
            if piece.calls:
                out.append({"tool_calls": piece.calls})
        return out

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(content, reasoning_content, tool calls) of a finished output."""
        content: list[str] = []
        reasoning: list[str] = []
        for delta in self.feed(text) + self.finish():
            content.append(delta.get("content", ""))
            reasoning.append(delta.get("reasoning_content", ""))
        answer = "".join(content)
        thought = "".join(reasoning) if self.reasoning is not None else None
        calls = self.calls
        return (answer or None) if calls else answer, thought or None, calls
