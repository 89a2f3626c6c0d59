"""Tool calls on the edges, through a live server: streamed and non-streamed replies agree.

A regex (SGLang's extra) makes the random model write an exact reply, with the tools offered
and tool_choice auto, so the output goes through the tool-call parser: text around a call, a
closing tag inside a string argument, and a reply max_tokens cuts at every token.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from minisgl.testing.tokenizer_builder import added_token_id

MSG = [{"role": "user", "content": "Run it."}]
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


def _call(args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(args)}}}\n</tool_call>'


def _literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join(
        "\\n" if ch == "\n" else "\\" + ch if ch in r".^$*+?()[]{}|\/" else ch for ch in text
    )


def _ask(client: openai.OpenAI, text: str, stream: bool, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="m",
        messages=MSG,  # type: ignore[arg-type]
        tools=[TOOL],  # type: ignore[list-item]
        temperature=0.0,
        stream=stream,
        extra_body={"regex": _literal(text)},
        **kw,
    )


def _both(client: openai.OpenAI, text: str, **kw: Any) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason), checked equal streamed and not."""
    whole = _ask(client, text, False, **kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    expected = (whole.message.content or "", calls, whole.finish_reason)
    content, slots, reason = "", {}, None
    for chunk in _ask(client, text, True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                slot = slots.setdefault(tc.index, ["", ""])
                slot[0] += tc.function.name or ""
                slot[1] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    streamed = (content, [(n, a) for n, a in (slots[i] for i in sorted(slots))], reason)
    assert streamed == expected
    return expected


@pytest.mark.parametrize(
    ("text", "content", "args"),
    [
        ("text before " + _call({"a": 1}) + " text after", "text before  text after", '{"a": 1}'),
        ("Sure.\n" + _call({"code": "</tool_call>"}), "Sure.", '{"code": "</tool_call>"}'),
    ],
)
def test_text_around_and_tag_in_string(
    client: openai.OpenAI, text: str, content: str, args: str
) -> None:
    assert _both(client, text, max_tokens=200) == (content, [("f", args)], "tool_calls")


def test_cut_at_every_token_shows_no_piece_of_a_tag(client: openai.OpenAI) -> None:
    """The opening tag spelled in pieces (its own token banned), so some cut lands inside it."""
    text = "Hi\n" + _call({"a": 1})
    ban = {str(added_token_id("<tool_call>")): -100}
    whole = _both(client, text, max_tokens=200, logit_bias=ban)
    assert whole == ("Hi", [("f", '{"a": 1}')], "tool_calls")
    # Cuts through the text, the opening tag and the call's name (the first 12 tokens; later
    # cuts are inside the arguments, which the parser's unit tests cover at every character).
    for n in range(1, 13):
        content, calls, reason = _both(client, text, max_tokens=n, logit_bias=ban)
        assert "<" not in content, n
        assert content in ("", "H", "Hi", "Hi\n"), n
        assert reason == "length" and len(calls) <= 1, n
