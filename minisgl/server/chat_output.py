"""A chat completion's text -> OpenAI message fields: reasoning_content, content, tool_calls.

The reasoning parser runs first (tool calls are never parsed out of the reasoning), then the
tool-call parser on the answer. Streaming and whole texts go through the same parsers, so the
deltas of a stream reassemble to the non-streaming message.

Tags the tokenizer marks special reach the parsers all the same (minisgl.structured.tags); one
the parsers leave over is dropped from the message, as skip_special_tokens would have.
"""

from __future__ import annotations

from typing import Any

from minisgl.structured.reasoning_parser import Qwen3ReasoningParser
from minisgl.structured.tags import REASONING_TAGS, TOOL_TAGS
from minisgl.structured.tool_parser import Qwen3ToolParser, ToolCall


class ChatOutput:
    def __init__(
        self,
        *,
        reasoning: bool,
        tools: bool,
        special_tags: tuple[str, ...] = (),
        thinking: bool = False,
    ) -> None:
        """special_tags: the parser tags the tokenizer marks special, when the request skips
        special tokens (the text then holds only those the parsers read: see `tags`).
        thinking: the prompt opened the think block (the output starts as reasoning)."""
        self.thinking = thinking
        self.reasoning = Qwen3ReasoningParser(started=thinking) if reasoning else None
        self.tools = Qwen3ToolParser() if tools else None
        self.special_tags = tuple(t for t in special_tags if t in self.tags)

    def fresh(self) -> ChatOutput:
        """A parser pair like this one with no state yet (one per choice)."""
        return ChatOutput(
            reasoning=self.reasoning is not None,
            tools=self.tools is not None,
            special_tags=self.special_tags,
            thinking=self.thinking,
        )

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags the active parsers read."""
        return (REASONING_TAGS if self.reasoning else ()) + (TOOL_TAGS if self.tools else ())

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The stream deltas (`delta` objects) for a new piece of text."""
        return self._deltas(text, final=False)

    def finish(self, *, cut: bool = False) -> list[dict[str, Any]]:
        """The last deltas; cut: max_tokens ended the output (see Qwen3ToolParser.finish)."""
        return self._deltas("", final=True, cut=cut)

    def _deltas(self, text: str, *, final: bool, cut: bool = False) -> list[dict[str, Any]]:
        out = self._parsed(text, final=final, cut=cut)
        if not self.special_tags:
            return out
        # A tag's text comes whole (one token) and the parsers hold back only what may begin
        # a tag they read, so a left-over tag never straddles two deltas.
        kept = []
        for delta in out:
            for key in ("content", "reasoning_content"):
                if key in delta:
                    delta[key] = self._drop_tags(delta[key])
            if (
                delta.get("content", "")
                or delta.get("reasoning_content", "")
                or "tool_calls" in delta
            ):
                kept.append(delta)
        return kept

    def _drop_tags(self, text: str) -> str:
        for tag in self.special_tags:
            text = text.replace(tag, "")
        return text

    def _parsed(self, text: str, *, final: bool, cut: bool) -> list[dict[str, Any]]:
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
            parts.append(self.tools.finish(cut=cut))
        for piece in parts:
            if piece.content:
                out.append({"content": piece.content})
            if piece.calls:
                out.append({"tool_calls": piece.calls})
        return out

    def whole(
        self, text: str, *, cut: bool = False
    ) -> tuple[str | None, str | None, list[ToolCall]]:
        """(content, reasoning_content, tool calls) of a finished output (cut: by max_tokens)."""
        content: list[str] = []
        reasoning: list[str] = []
        for delta in self.feed(text) + self.finish(cut=cut):
            content.append(delta.get("content", ""))
            reasoning.append(delta.get("reasoning_content", ""))
        answer = "".join(content)
        thought = "".join(reasoning) if self.reasoning is not None else None
        calls = self.calls
        return (answer or None) if calls else answer, thought or None, calls
