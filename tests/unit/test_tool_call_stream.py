"""Streamed tool calls equal the non-streamed ones, for any call and any chunking.

Property tests over random calls as Qwen3 writes them (and as fine-tunes get them slightly
wrong: arguments as a JSON string, extra keys after the arguments, odd whitespace, a reply cut
short), split into random chunks: the streamed deltas joined are the non-streamed `arguments`,
byte for byte, and a well-formed call's arguments are valid JSON of the object it wrote.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.server.chat_output import ChatOutput
from minisgl.structured.tool_parser import Qwen3ToolParser

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(alphabet='ab }{"\\:,\n<>/é', max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
_args = st.dictionaries(st.text(alphabet='abc_}{" ', max_size=5), _values, max_size=4)
_space = st.sampled_from(["", " ", "\n", "  ", "\t"])
_content = st.text(alphabet="ab <>{}\n/_", max_size=12)


@st.composite
def _call(draw: st.DrawFn) -> tuple[str, dict[str, Any], str]:
    """(name, arguments object, the block's body as the model wrote it)."""
    name = draw(st.text(alphabet="abcdefgh_", min_size=1, max_size=8))
    args = draw(_args)
    sep = draw(st.sampled_from([(", ", ": "), (",", ":"), (" ,  ", " :\n")]))
    indent = draw(st.sampled_from([None, 2]))
    args_text = json.dumps(args, separators=sep, indent=indent, ensure_ascii=draw(st.booleans()))
    if draw(st.booleans()):  # some fine-tunes write the arguments as a JSON string
        args_text = json.dumps(args_text)
    middle = draw(st.dictionaries(st.sampled_from(["id", "type", "x"]), _values, max_size=2))
    after = draw(st.dictionaries(st.sampled_from(["id", "index", "y"]), _values, max_size=2))
    s1, s2, s3 = draw(_space), draw(_space), draw(_space)
    parts = [f'"name":{s1}{json.dumps(name)}']
    parts += [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in middle.items()]
    parts.append(f'"arguments":{s2}{args_text}')
    parts += [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in after.items()]
    body = f"{s3}{{{(',' + s1).join(parts)}{s2}}}{s3}"
    return name, args, body


@st.composite
def _reply(draw: st.DrawFn) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """A whole reply: content, then calls, as Qwen3's template renders them."""
    calls = draw(st.lists(_call(), min_size=1, max_size=3))
    text = draw(_content).replace("<", "")  # no stray partial tags in this content
    for _, _, body in calls:
        text += f"\n<tool_call>\n{body}\n</tool_call>"
    return text, [(name, args) for name, args, _ in calls]


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def _streamed(chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) as a client joins the deltas of a stream."""
    out = ChatOutput(reasoning=False, tools=True)
    deltas = [d for c in chunks for d in out.feed(c)] + out.finish()
    content = ""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            slot = calls.setdefault(c["index"], ["", ""])
            if "id" in c:
                assert not slot[0], "a call's name is sent once, in its first delta"
                slot[0] = c["function"]["name"]
            slot[1] += c["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)]


def _whole(text: str) -> tuple[str, list[tuple[str, str]]]:
    content, _, calls = ChatOutput(reasoning=False, tools=True).whole(text)
    return content or "", [(c.name, c.arguments) for c in calls]


@settings(max_examples=150, deadline=None)
@given(_reply(), st.lists(st.integers(0, 10**6), max_size=40))
def test_stream_equals_whole_and_arguments_are_the_object(
    reply: tuple[str, list[tuple[str, dict[str, Any]]]], cuts: list[int]
) -> None:
    text, expected = reply
    whole = _whole(text)
    assert _streamed(_chunks(text, cuts)) == whole
    assert [name for name, _ in whole[1]] == [name for name, _ in expected]
    for (_, args), (_, obj) in zip(whole[1], expected, strict=True):
        assert json.loads(args) == obj


@settings(max_examples=150, deadline=None)
@given(_reply(), st.integers(0, 10**6), st.lists(st.integers(0, 10**6), max_size=40))
def test_a_reply_cut_anywhere_streams_as_it_parses(
    reply: tuple[str, list[tuple[str, dict[str, Any]]]], cut: int, cuts: list[int]
) -> None:
    """max_tokens may end the reply mid-call: whatever the parse makes of it, the stream
    made the same."""
    text = reply[0][: cut % (len(reply[0]) + 1)]
    assert _streamed(_chunks(text, cuts)) == _whole(text)


def test_the_two_reported_cases() -> None:
    as_string = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    key_after = '<tool_call>\n{"name": "f", "arguments": {"a": 1}, "id": 2}\n</tool_call>'
    for text in (as_string, key_after):
        assert _whole(text) == ("", [("f", '{"a": 1}')])
        for size in (1, 2, 3, 5, 8):
            chunks = [text[i : i + size] for i in range(0, len(text), size)]
            assert _streamed(chunks) == ("", [("f", '{"a": 1}')]), size
    assert Qwen3ToolParser.parse(key_after)[1][0].arguments == '{"a": 1}'
