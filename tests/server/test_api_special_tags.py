"""Tool calls and reasoning whatever the tokenizer's special flag on their tags.

Qwen3 leaves `<tool_call>`, `</tool_call>`, `<think>` and `</think>` plain; some Qwen-family
tokenizers and fine-tunes mark them special, and the default skip_special_tokens would drop
them before the parsers see the text. Each test runs against a server on each kind of
tokenizer. A logit bias makes the random model write each tag as its one token (where the
grammar allows it), so the special case is really exercised.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from harness import ServerProcess

from minisgl.testing.tokenizer_builder import PARSER_TAGS, added_token_id, mark_special

MSG = [{"role": "user", "content": "What time is it?"}]
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
# Where the grammar allows a tag, the model writes its single token.
TAG_BIAS = {str(added_token_id(t)): 100 for t in PARSER_TAGS}
IM_START = added_token_id("<|im_start|>")


@pytest.fixture(scope="module")
def special_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from minisgl.testing.fixture import write_fixture_model

    model = write_fixture_model(tmp_path_factory.mktemp("qwen3-special-tags"), "tiny")
    mark_special(model, PARSER_TAGS)
    log = tmp_path_factory.mktemp("special-server") / "server.log"
    flags = ("--num-pages", "512", "--page-size", "16", "--log-level", "info")
    srv = ServerProcess(model, log, *flags).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(params=["plain", "special"])
def tags(request: pytest.FixtureRequest) -> str:
    """Which tokenizer the `client` talks to: one with the tags plain, or special."""
    return str(request.param)


@pytest.fixture
def client(request: pytest.FixtureRequest, tags: str) -> openai.OpenAI:
    srv: ServerProcess = request.getfixturevalue("server" if tags == "plain" else "special_server")
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=600)


def _reassemble(chunks: list[Any]) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """(content, reasoning, [(name, arguments)], finish_reason) of a chat stream."""
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, ["", ""])
                slot[0] += tc.function.name or ""
                slot[1] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, reasoning, [(n, a) for n, a in (calls[i] for i in sorted(calls))], reason


def test_forced_tool_call_is_parsed(client: openai.OpenAI) -> None:
    request: dict[str, Any] = dict(
        model="m",
        messages=MSG,
        tools=[CLOCK],
        tool_choice="required",
        temperature=1.0,
        seed=3,
        max_tokens=60,
        parallel_tool_calls=False,
        logit_bias=TAG_BIAS,
    )
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].function.arguments), CLOCK["function"]["parameters"])
    content, reasoning, streamed, reason = _reassemble(
        list(client.chat.completions.create(**request, stream=True))
    )
    assert (content, reasoning, reason) == ("", "", "tool_calls")
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]


def test_reasoning_is_split(client: openai.OpenAI) -> None:
    request: dict[str, Any] = dict(
        model="m",
        messages=MSG,
        temperature=1.0,
        seed=4,
        max_tokens=40,
        logit_bias=TAG_BIAS,
        extra_body={"ebnf": 'root ::= "<think>" [a-z]{3,6} "</think>" "\\n\\n" [a-z]{2,5}'},
    )
    msg = client.chat.completions.create(**request).choices[0].message
    reasoning = msg.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and reasoning.isalpha() and 3 <= len(reasoning) <= 6
    assert msg.content and msg.content.isalpha()
    content, streamed_reasoning, calls, _ = _reassemble(
        list(client.chat.completions.create(**request, stream=True))
    )
    assert (content, streamed_reasoning, calls) == (msg.content, reasoning, [])


def test_content_carries_no_special_token(client: openai.OpenAI, tags: str) -> None:
    """A tag left over after parsing is content only where it is plain text, like any
    special token (here <|im_start|>) it is dropped: the message reads as skipping would."""
    request: dict[str, Any] = dict(
        model="m",
        messages=MSG,
        tools=[CLOCK],
        temperature=1.0,
        seed=5,
        max_tokens=40,
        logit_bias={**TAG_BIAS, str(IM_START): 100},
        extra_body={
            "ebnf": 'root ::= "<think>" [a-z]{3} "</think>" "ok" "</think>" "<|im_start|>" "x"'
        },
    )
    msg = client.chat.completions.create(**request).choices[0].message
    reasoning = msg.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and reasoning.isalpha() and len(reasoning) == 3
    assert msg.content == ("ok</think>x" if tags == "plain" else "okx") and not msg.tool_calls
    content, streamed_reasoning, calls, _ = _reassemble(
        list(client.chat.completions.create(**request, stream=True))
    )
    assert (content, streamed_reasoning, calls) == (msg.content, reasoning, [])
