"""Qwen3's tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks.

A whole text and a stream follow one rule, so the streamed deltas reassemble to the
non-streaming answer: text outside the blocks is content (a block's tags never leak into
it); each well-formed block is a call whose `arguments` is the model's own JSON text of the
arguments object, byte for byte. A block that is not a JSON object with a string `name` stays
content, as the model wrote it.

Streaming emits OpenAI's `delta.tool_calls` shape: the first delta of a call carries its index,
id, type and name (with empty arguments), later ones argument fragments only.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from minisgl.structured.holdback import partial_marker_len

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
PARSERS = ("qwen3",)
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _name_and_args_start(body: str) -> tuple[str, int] | None:
    """The call's name, and where its arguments value starts, once both are in `body`.

    Works on a prefix of the block's body: the name is known once its string closed and the
    `"arguments":` key after it was written.
    """
    start = body.find("{")
    if start < 0 or body[:start].strip():
        return None
    pos = start + 1
    name: str | None = None
    args_at = -1
    while True:
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(body) or body[pos] != '"':
            return None
        try:
            key, pos = _DECODER.raw_decode(body, pos)
        except ValueError:
            return None
        while pos < len(body) and body[pos] in " \t\r\n":
            pos += 1
        if pos >= len(body) or body[pos] != ":":
            return None
        pos += 1
        while pos < len(body) and body[pos] in " \t\r\n":
            pos += 1
        if key == "arguments":
            if name is None:
                return None  # Qwen3 writes the name first; anything else is not a call
            args_at = pos
            return (name, args_at) if pos < len(body) else None
        try:
            value, pos = _DECODER.raw_decode(body, pos)
        except ValueError:
            return None
        if key == "name":
            if not isinstance(value, str):
                return None
            name = value


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, raw arguments JSON) of one complete block body, or None when malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if not isinstance(obj.get("arguments", {}), dict):
        return None
    head = _name_and_args_start(body)
    if head is None:
        return obj["name"], "{}" if "arguments" not in obj else json.dumps(obj["arguments"])
    name, at = head
    _, end = _DECODER.raw_decode(body, at)
    return name, body[at:end]


@dataclass
class _OpenCall:
    index: int
    id: str = ""
    name: str | None = None
    args_at: int = -1
    sent_args: int = 0  # chars of the arguments text already streamed


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI delta.tool_calls items


class Qwen3ToolParser:
    """Incremental parser; `feed` chunks, then `finish` once. Whole texts: `parse`.

    Whitespace next to a block (Qwen3 puts a newline between content and calls, and between
    calls) is not content; a stream holds trailing whitespace back until it knows.
    """

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.after_call = False  # drop whitespace until the next non-space content
        self.open: _OpenCall | None = None
        self.gap = ""  # whitespace before the open block: content again if it is no call
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> ToolDelta:
        self.buffer += text
        out = ToolDelta()
        while True:
            if self.in_call:
                end = self.buffer.find(CALL_END)
                if end < 0:
                    self._stream_partial(out)
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(CALL_END) :]
                self._close(body, out, closed=True)
                continue
            if self.after_call:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return out
                self.after_call = False
            at = self.buffer.find(CALL_START)
            if at >= 0:
                before = self.buffer[:at]
                out.content += before.rstrip()
                self.gap = before[len(before.rstrip()) :]
                self.buffer = self.buffer[at + len(CALL_START) :]
                self.in_call = True
                self.open = _OpenCall(len(self.calls))
                continue
            keep = partial_marker_len(self.buffer, (CALL_START,))
            cut = len(self.buffer) - keep
            cut = len(self.buffer[:cut].rstrip())  # maybe the newline before a call
            out.content += self.buffer[:cut]
            self.buffer = self.buffer[cut:]
            return out

    def _stream_partial(self, out: ToolDelta) -> None:
        call = self.open
        assert call is not None
        body = self.buffer
        if call.name is None:
            head = _name_and_args_start(body)
            if head is None:
                return
            call.name, call.args_at = head
            call.id = new_call_id()
            out.calls.append(_first_delta(call.index, call.id, call.name))
        # Hold back what may be the start of </tool_call>, then the closing of the outer object.
        body = body[: len(body) - partial_marker_len(body, (CALL_END,))]
        safe = body.rstrip(" \t\r\n}")
        frag = safe[call.args_at + call.sent_args :]
        if frag:
            call.sent_args += len(frag)
            out.calls.append({"index": call.index, "function": {"arguments": frag}})

    def _close(self, body: str, out: ToolDelta, *, closed: bool) -> None:
        call = self.open
        assert call is not None
        self.open = None
        self.in_call = False
        parsed = parse_call(body)
        if parsed is None and call.name is None:  # nothing was streamed as a call: content
            out.content += self.gap + CALL_START + body + (CALL_END if closed else "")
            return
        if parsed is None:
            # Cut short (max_tokens) or malformed after its name: a call with what was written.
            assert call.name is not None
            parsed = call.name, body[call.args_at :].rstrip()
        self.after_call = True
        name, args = parsed
        if call.name is None:
            call.id = new_call_id()
            out.calls.append(_first_delta(call.index, call.id, name))
        sent = body[call.args_at : call.args_at + call.sent_args] if call.args_at >= 0 else ""
        rest = args[len(sent) :] if args.startswith(sent) else ""
        if rest:
            out.calls.append({"index": call.index, "function": {"arguments": rest}})
        self.calls.append(ToolCall(call.id, name, args))

    def finish(self) -> ToolDelta:
        """The end of the output: an unclosed block is a call when it parses, else content."""
        out = ToolDelta()
        if self.in_call:
            body, self.buffer = self.buffer, ""
            self._close(body, out, closed=False)
        elif not self.after_call:
            out.content = self.buffer
        self.buffer = ""
        return out

    @classmethod
    def parse(cls, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        parser = cls()
        a, b = parser.feed(text), parser.finish()
        return a.content + b.content, parser.calls


def _first_delta(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
