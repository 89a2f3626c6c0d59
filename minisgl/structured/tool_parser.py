"""Qwen3's tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks.

A whole text and a stream follow one rule, so the streamed deltas reassemble to the
non-streaming answer, whatever the chunking: text outside the blocks is content (a block's
tags never leak into it). A block is a call once its body names the function and opens the
`arguments` value with `{` or `"` (Qwen3 writes the name first); its `arguments` is then a
function of the body alone: the model's own JSON text of the arguments object, byte for byte,
up to where that value ends (keys after it are not arguments); for arguments written as a JSON
string, the string's text when it holds a JSON object. A block cut short (max_tokens) is a
call with what was written; cut before its name (or inside `<tool_call>`), it is dropped. A
closing tag inside a string of the body's JSON object is text, not the block's end. Other blocks are calls when the whole body is a JSON object with a
string `name` and object `arguments`; else they stay content, as the model wrote them.

Streaming emits OpenAI's `delta.tool_calls` shape: the first delta of a call carries its index,
id, type and name (with empty arguments), later ones argument fragments only, each a piece of
the final `arguments` (text that may still change, such as trailing whitespace, is held back).
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
            if pos >= len(body) or body[pos] not in '{"':
                return None  # not started yet, or not an object: the whole body decides
            return name, pos
        try:
            value, pos = _DECODER.raw_decode(body, pos)
        except ValueError:
            return None
        if key == "name":
            if not isinstance(value, str):
                return None
            name = value


def _value_end(body: str, at: int) -> int | None:
    """Where the JSON object or string starting at body[at] ends, or None if it has not yet.

    Only brackets and strings are tracked: the end is where the value closes, whether or not
    the text in between is valid JSON (the model's text is passed on as written).
    """
    depth = 0
    in_string = False
    escaped = False
    for i in range(at, len(body)):
        ch = body[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _block_end(text: str) -> int | None:
    """Where the open block's `</tool_call>` starts in `text` (what follows `<tool_call>`).

    A body that is a JSON object ends at the first tag outside its strings: a string argument
    may hold the tag's text. A raw newline in a string is not JSON (Qwen3 writes one before
    the tag), so from there, as for a body that is not an object, the first tag ends it.
    """
    i = len(text) - len(text.lstrip())
    if text.startswith("{", i):
        depth = 0
        in_string = escaped = False
        while i < len(text):
            ch = text[i]
            if in_string:
                if ch == "\n":
                    break
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif text.startswith(CALL_END, i):
                return i
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    break
            i += 1
    at = text.find(CALL_END, i)
    return at if at >= 0 else None


def _string_arguments(raw: str) -> str:
    """Arguments written as a JSON string: its text when that is a JSON object, else as is."""
    try:
        text = json.loads(raw)
        return text if isinstance(json.loads(text), dict) else raw
    except ValueError:
        return raw


def arguments_text(body: str, at: int) -> str:
    """The `arguments` of a call whose arguments value starts at body[at] ({ or ")."""
    end = _value_end(body, at)
    if end is None:  # cut short: what was written
        return body[at:].rstrip()
    if body[at] == '"':
        return _string_arguments(body[at:end])
    return body[at:end]


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one complete block body, or None when it is not a call."""
    head = _name_and_args_start(body)
    if head is not None:
        name, at = head
        return name, arguments_text(body, at)
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


@dataclass
class _OpenCall:
    index: int
    id: str = ""
    name: str | None = None
    args_at: int = -1
    sent: str = ""  # the arguments text streamed so far: always a prefix of the final one


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI delta.tool_calls items


class Qwen3ToolParser:
    """Incremental parser; `feed` chunks, then `finish` once. Whole texts: `parse`.

    Content is the text outside the calls as written, except the whitespace between a call and
    the start or the end of the content (Qwen3 puts a newline between content and calls, and
    between calls): "Sure.\n<call>" is "Sure.", "a <call> b" is "a  b". A stream holds
    whitespace back until it knows which.
    """

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.after_call = False  # whitespace goes to `pending` until the next non-space
        self.open: _OpenCall | None = None
        self.gap = ""  # whitespace right before the open block
        self.pending = ""  # whitespace next to a call: content once more content follows
        self.said = False  # some content was sent (so whitespace after a call is inside it)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> ToolDelta:
        self.buffer += text
        out = ToolDelta()
        while True:
            if self.in_call:
                end = _block_end(self.buffer)
                if end is None:
                    self._stream_partial(out)
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(CALL_END) :]
                self._close(body, out, closed=True)
                continue
            if self.after_call:
                rest = self.buffer.lstrip()
                self.pending += self.buffer[: len(self.buffer) - len(rest)]
                self.buffer = rest
                if not self.buffer:
                    return out
                self.after_call = False
            at = self.buffer.find(CALL_START)
            if at >= 0:
                before = self.buffer[:at]
                self._say(out, before.rstrip())
                self.gap = before[len(before.rstrip()) :]
                self.buffer = self.buffer[at + len(CALL_START) :]
                self.in_call = True
                self.open = _OpenCall(len(self.calls))
                continue
            keep = partial_marker_len(self.buffer, (CALL_START,))
            cut = len(self.buffer) - keep
            cut = len(self.buffer[:cut].rstrip())  # maybe the newline before a call
            self._say(out, self.buffer[:cut])
            self.buffer = self.buffer[cut:]
            return out

    def _say(self, out: ToolDelta, text: str) -> None:
        """Send content; whitespace after a call leads it only when content came before."""
        if not text:
            return
        out.content += (self.pending if self.said else "") + text
        self.pending = ""
        self.said = True

    def _stream_partial(self, out: ToolDelta) -> None:
        call = self.open
        assert call is not None
        # What may be the start of </tool_call> is not part of the body yet.
        body = self.buffer[: len(self.buffer) - partial_marker_len(self.buffer, (CALL_END,))]
        if call.name is None:
            head = _name_and_args_start(body)
            if head is None:
                return
            call.name, call.args_at = head
            call.id = new_call_id()
            out.calls.append(_first_delta(call.index, call.id, call.name))
        at = call.args_at
        if body[at] == '"':
            return  # arguments as a JSON string: known once the string closes
        end = _value_end(body, at)
        # Unclosed, trailing whitespace may yet be the end of a reply cut short.
        stable = body[at:end] if end is not None else body[at:].rstrip()
        frag = stable[len(call.sent) :]
        if frag:
            call.sent += frag
            out.calls.append({"index": call.index, "function": {"arguments": frag}})

    def _close(self, body: str, out: ToolDelta, *, closed: bool, cut: bool = False) -> None:
        call = self.open
        assert call is not None
        self.open = None
        self.in_call = False
        parsed = parse_call(body)
        if parsed is None:  # not a call (nothing was streamed as one: see the module doc)
            assert call.name is None
            if not cut:  # a block cut before its name is a call never written: no content
                self._say(out, self.gap + CALL_START + body + (CALL_END if closed else ""))
            return
        self.after_call = True
        self.pending += self.gap
        name, args = parsed
        if call.name is None:
            call.id = new_call_id()
            out.calls.append(_first_delta(call.index, call.id, name))
        assert args.startswith(call.sent), (args, call.sent)
        rest = args[len(call.sent) :]
        if rest:
            out.calls.append({"index": call.index, "function": {"arguments": rest}})
        self.calls.append(ToolCall(call.id, name, args))

    def finish(self, *, cut: bool = False) -> ToolDelta:
        """The end of the output: an unclosed block is a call when it parses, else content.

        cut: max_tokens ended the output. Then an unclosed block that does not parse yet, or
        the start of an opening tag, is a call cut before its name: neither content nor a call.
        """
        out = ToolDelta()
        if self.in_call:
            body, self.buffer = self.buffer, ""
            self._close(body, out, closed=False, cut=cut)
        else:
            tag = partial_marker_len(self.buffer, (CALL_START,)) if cut else 0
            rest = self.buffer[: len(self.buffer) - tag]
            self._say(out, rest.rstrip() if tag else rest)
        self.buffer = ""
        return out

    @classmethod
    def parse(cls, text: str, *, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output (cut: max_tokens ended it)."""
        parser = cls()
        a, b = parser.feed(text), parser.finish(cut=cut)
        return a.content + b.content, parser.calls


def _first_delta(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
