"""Qwen3ToolParser on the edges of a call: the text around it, a closing tag inside a string
argument, and a reply that max_tokens cut inside a tag. Each case is checked whole and streamed
in every chunk size (the deltas joined are the whole answer)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.server.chat_output import ChatOutput
from minisgl.structured.tool_parser import Qwen3ToolParser


def _call(name: str, args: dict[str, object]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


C = _call("f", {"a": 1})
F = ("f", '{"a": 1}')
TAG_IN_STRING = {"code": 'print("</tool_call>")', "n": 2}

# (text, cut by max_tokens, expected content, expected [(name, arguments)])
CASES = [
    # The text outside the calls is content as written, less the whitespace between a call
    # and the start or end of the content.
    ("text before " + C + " text after", False, "text before  text after", [F]),
    ("Sure.\n" + C, False, "Sure.", [F]),
    ("Sure.\n" + C + "\n" + C + "\nDone.\n", False, "Sure.\n\n\nDone.\n", [F, F]),
    (C + "\nDone.", False, "Done.", [F]),
    ("a" + C + "b", False, "ab", [F]),
    ("a \n" + C + "\n", False, "a", [F]),
    ("x <tool_call>no</tool_call> y", False, "x <tool_call>no</tool_call> y", []),
    (C + "\n<tool_call>no</tool_call>", False, "<tool_call>no</tool_call>", [F]),
    ("a " + C + "\n<tool_call>no</tool_call>", False, "a \n<tool_call>no</tool_call>", [F]),
    # A closing tag inside a JSON string is the string's text.
    (_call("g", TAG_IN_STRING) + "\n" + C, False, "", [("g", json.dumps(TAG_IN_STRING)), F]),
    ("ok " + _call("g", {"s": "</tool_call"}), False, "ok", [("g", '{"s": "</tool_call"}')]),
    # ...but a raw newline is no JSON string: the first tag after it ends the block.
    (
        '<tool_call>\n{"name": "h", "arguments": {"s": "x}}\n</tool_call>\nok',
        False,
        "ok",
        [("h", '{"s": "x}}')],
    ),
    # Cut by max_tokens inside a tag or before the name: no tag text leaks into content.
    (C + "\n<to", True, "", [F]),
    ("Sure.\n<tool_ca", True, "Sure.", []),
    ('Sure.\n<tool_call>\n{"na', True, "Sure.", []),
    ("Sure. <", True, "Sure.", []),
    ('<tool_call>\n{"name": "f", "arguments": {"a"', True, "", [("f", '{"a"')]),
    # Ended by the model (or a stop string), such text is the model's content.
    (C + "\n<to", False, "<to", [F]),
    ("Sure. <", False, "Sure. <", []),
    ('Sure.\n<tool_call>\n{"na', False, 'Sure.\n<tool_call>\n{"na', []),
]


def _streamed(chunks: list[str], cut: bool) -> tuple[str, list[tuple[str, str]]]:
    parser = Qwen3ToolParser()
    deltas = [parser.feed(c) for c in chunks] + [parser.finish(cut=cut)]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.calls:
            slot = calls.setdefault(c["index"], ["", ""])
            slot[0] += c["function"].get("name", "")
            slot[1] += c["function"]["arguments"]
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)]


@pytest.mark.parametrize(("text", "cut", "content", "calls"), CASES)
def test_whole_and_every_chunking(
    text: str, cut: bool, content: str, calls: list[tuple[str, str]]
) -> None:
    got_content, got_calls = Qwen3ToolParser.parse(text, cut=cut)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    for size in range(1, len(text) + 1):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        assert _streamed(chunks, cut) == (content, calls), size


@pytest.mark.parametrize(("text", "cut", "content", "calls"), CASES)
def test_chat_output_agrees(text: str, cut: bool, content: str, calls: object) -> None:
    whole_content, _, whole_calls = ChatOutput(reasoning=True, tools=True).whole(text, cut=cut)
    assert (whole_content or "") == content
    streamed = ChatOutput(reasoning=True, tools=True)
    deltas = [d for ch in text for d in streamed.feed(ch)] + streamed.finish(cut=cut)
    assert "".join(d.get("content", "") for d in deltas) == content
    assert len(streamed.calls) == len(whole_calls)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["Hi", " ", "\n", "x y", C, _call("g", TAG_IN_STRING)]), max_size=6),
    st.integers(0, 10**6),
)
def test_any_reply_cut_anywhere_leaks_no_tag(parts: list[str], at: int) -> None:
    """A reply cut by max_tokens at any character: stream and whole agree, the content holds
    no piece of a tag, and every call the cut spared is whole."""
    reply = "".join(parts)
    text = reply[: at % (len(reply) + 1)]
    content, calls = Qwen3ToolParser.parse(text, cut=True)
    assert "<" not in content
    assert _streamed(list(text), cut=True) == (content, [(c.name, c.arguments) for c in calls])
    whole = Qwen3ToolParser.parse(reply)[1]
    assert [(c.name, c.arguments) for c in calls[:-1]] == [
        (c.name, c.arguments) for c in whole[: max(len(calls) - 1, 0)]
    ]
