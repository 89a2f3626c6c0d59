"""Qwen3 tool-call and reasoning parsers: streams in any chunking reassemble to the whole-text
answer, and tag text never leaks into content."""

from __future__ import annotations

import json
import random

import pytest

from minisgl.server.chat_output import ChatOutput
from minisgl.structured.reasoning_parser import Qwen3ReasoningParser
from minisgl.structured.spec import choice_ebnf
from minisgl.structured.tool_parser import Qwen3ToolParser

TWO_CALLS = (
    "Sure.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "u": {"a": [1, {"b": "}"}]}}}\n'
    '</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
)
TOOL_TEXTS = [
    TWO_CALLS,
    "hello <tool_call> not json </tool_call> x\n",
    "plain answer\n",
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}',  # cut off by max_tokens
    "a <tool_ca",
    '<tool_call>\n{"arguments": {}, "name": "f"}\n</tool_call>',
]


def _stream_tools(text: str, rng: random.Random) -> tuple[str, list[tuple[str, str, str]]]:
    parser = Qwen3ToolParser()
    content = ""
    calls: dict[int, list[str]] = {}
    i = 0
    deltas = []
    while i < len(text):
        n = rng.randint(1, 5)
        deltas.append(parser.feed(text[i : i + n]))
        i += n
    deltas.append(parser.finish())
    for d in deltas:
        content += d.content
        for c in d.calls:
            slot = calls.setdefault(c["index"], ["", "", ""])
            if "id" in c:
                slot[0], slot[1] = c["id"], c["function"]["name"]
            slot[2] += c["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)]  # type: ignore[misc]


@pytest.mark.parametrize("text", TOOL_TEXTS)
def test_tool_stream_reassembles_to_whole(text: str) -> None:
    content, calls = Qwen3ToolParser.parse(text)
    assert "<tool_call>" not in content or not calls
    rng = random.Random(0)
    for _ in range(30):
        s_content, s_calls = _stream_tools(text, rng)
        assert s_content == content
        assert [(n, a) for _, n, a in s_calls] == [(c.name, c.arguments) for c in calls]


def test_tool_calls_parsed() -> None:
    content, calls = Qwen3ToolParser.parse(TWO_CALLS)
    assert content == "Sure."
    assert [c.name for c in calls] == ["get_weather", "f"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "u": {"a": [1, {"b": "}"}]}}
    assert calls[1].arguments == "{}"
    assert all(c.id.startswith("call_") for c in calls)
    # Not a call: the text stays content, as written.
    assert Qwen3ToolParser.parse("a <tool_call>x</tool_call>") == (
        "a <tool_call>x</tool_call>",
        [],
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\nhmm\n</think>\n\nanswer", ("\nhmm\n", "answer")),
        (" <think>abc", ("abc", "")),  # cut off while thinking
        ("answer <think>x</think>", ("", "answer <think>x</think>")),
        ("<thi", ("", "<thi")),
        ("\n\nfoo", ("", "\n\nfoo")),
    ],
)
def test_reasoning_split_and_stream(text: str, expected: tuple[str, str]) -> None:
    assert Qwen3ReasoningParser.split(text) == expected
    rng = random.Random(1)
    for _ in range(30):
        p = Qwen3ReasoningParser()
        r = c = ""
        i = 0
        while i < len(text):
            n = rng.randint(1, 3)
            d = p.feed(text[i : i + n])
            r, c, i = r + d.reasoning, c + d.content, i + n
        d = p.finish()
        assert (r + d.reasoning, c + d.content) == expected


def test_chat_output_reasoning_then_tools() -> None:
    text = "<think>plan</think>\n\n" + TWO_CALLS
    out = ChatOutput(reasoning=True, tools=True)
    content, reasoning, calls = out.whole(text)
    assert (content, reasoning) == ("Sure.", "plan")
    assert [c.name for c in calls] == ["get_weather", "f"]
    streamed = ChatOutput(reasoning=True, tools=True)
    deltas = [d for ch in text for d in streamed.feed(ch)] + streamed.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan"
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    assert not any("<" in d.get("content", "") for d in deltas)


def test_choice_grammar() -> None:
    assert choice_ebnf(['a"b', "ü"]) == 'root ::= "a\\"b" | "ü"'


def test_parsers_follow_the_flags_and_the_template(tiny_model_dir) -> None:
    from minisgl.structured.chat_template import read_chat_template, reasoning_on, tool_calls_on

    qwen3 = read_chat_template(tiny_model_dir)
    assert qwen3 is not None and "<tool_call>" in qwen3
    assert reasoning_on("auto", qwen3) and tool_calls_on("auto", qwen3)
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not reasoning_on("auto", plain) and not tool_calls_on("auto", plain)
    assert not reasoning_on("none", qwen3) and not tool_calls_on("none", qwen3)
    assert reasoning_on("qwen3", plain) and tool_calls_on("qwen3", None)
