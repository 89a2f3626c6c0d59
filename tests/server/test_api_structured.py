"""Structured outputs, tool calling and reasoning over HTTP with the official openai client.

The model has random weights: whatever it writes inside a grammar must still parse and
validate, and forced tool calls must round-trip through Qwen3's chat template.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from harness import ServerProcess

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """A patient client: the first constrained request sets xgrammar up in the scheduler (a
    few seconds, much longer on a busy machine), and grammars compile on first use."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
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
TOOLS = [WEATHER, CLOCK]


def _random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Objects, enums, bounded numbers and arrays, nested: what a random model must obey."""
    kinds = ["int", "num", "enum", "bool", "str"] + (["obj", "arr"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "num":
        lo = rng.choice([-2.5, 0, 1.25])
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 10, 100])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", "ünï"], rng.randint(1, 4))}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "str":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "arr":
        return {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": 3}
    n = rng.randint(1, 3)
    props = {f"k{i}": _random_schema(rng, depth + 1) for i in range(n)}
    return {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    }


def test_json_schema_outputs_validate(client: openai.OpenAI) -> None:
    rng = random.Random(11)
    for i in range(20):
        schema = _random_schema(rng)
        if schema.get("type") != "object":
            schema = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
        reply = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"JSON {i}"}],
            temperature=1.0,
            seed=i,
            max_tokens=400,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_object_regex_choice_ebnf_both_endpoints(client: openai.OpenAI) -> None:
    obj = client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=1.0,
        seed=3,
        max_tokens=300,
        response_format={"type": "json_object"},
    )
    # Free keys and strings: a random model may not close them within max_tokens.
    text = obj.choices[0].message.content or ""
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    reg = client.completions.create(
        model="m",
        prompt="Code:",
        temperature=1.0,
        seed=4,
        max_tokens=20,
        extra_body={"regex": r"[A-Z]{3}-\d{2}"},
    )
    text = reg.choices[0].text
    assert len(text) == 6 and text[:3].isupper() and text[3] == "-" and text[4:].isdigit()
    vllm_regex = client.completions.create(
        model="m",
        prompt="Code:",
        temperature=1.0,
        seed=4,
        max_tokens=20,
        extra_body={"guided_regex": r"[A-Z]{3}-\d{2}"},
    )
    assert vllm_regex.choices[0].text == text
    pick = client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=1.0,
        seed=5,
        max_tokens=20,
        extra_body={"guided_choice": ["sunny", "rainy"]},
    )
    assert pick.choices[0].message.content in ("sunny", "rainy")
    ebnf = client.completions.create(
        model="m",
        prompt="Answer:",
        temperature=1.0,
        seed=6,
        max_tokens=20,
        extra_body={"ebnf": 'root ::= "yes" | "no" | "maybe"'},
    )
    assert ebnf.choices[0].text in ("yes", "no", "maybe")
    guided = client.completions.create(
        model="m",
        prompt="J:",
        temperature=1.0,
        seed=7,
        max_tokens=100,
        extra_body={
            "guided_json": {
                "type": "object",
                "properties": {"a": {"enum": [1, 2]}},
                "required": ["a"],
            }
        },
    )
    assert json.loads(guided.choices[0].text)["a"] in (1, 2)


def test_constrained_stream_and_length_cut(client: openai.OpenAI) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "n",
            "schema": {
                "type": "object",
                "properties": {"a": {"type": "array", "items": {"enum": ["x"]}}},
                "required": ["a"],
            },
        },
    }
    whole = client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=1.0,
        seed=9,
        max_tokens=200,
        response_format=fmt,
    )
    stream = client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=1.0,
        seed=9,
        max_tokens=200,
        response_format=fmt,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    cut = client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=1.0,
        seed=9,
        max_tokens=3,
        response_format=fmt,
    )
    assert cut.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "response_format",
            "frobnicate",
        ),
        ({"regex": "([a-z"}, "regex", "regex is invalid"),
        ({"ebnf": 'root ::= "a" missing_rule'}, "ebnf", "missing_rule"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"regex": "a", "guided_choice": ["b"]}, "guided_choice", "one structured output"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
    ],
)
def test_bad_grammar_is_400(server: ServerProcess, body: dict, param: str, needle: str) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 5, **body},
        timeout=600,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def _reassemble(chunks: list[Any]) -> tuple[str, list[dict[str, str]], str | None]:
    content, calls, reason = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        reason = c.choices[0].finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_tool_call_round_trip(client: openai.OpenAI, choice: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    request: dict[str, Any] = dict(
        model="m",
        messages=messages,
        tools=TOOLS,
        tool_choice=choice,
        temperature=1.0,
        seed=21,
        max_tokens=200,
        parallel_tool_calls=False,  # a random model would go on
    )
    first = client.chat.completions.create(**request)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls and not msg.content
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in msg.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.tool_calls] == ["get_time"]
    # The stream of the same seeded request reassembles to the same calls.
    stream = client.chat.completions.create(**request, stream=True)
    content, calls, reason = _reassemble(list(stream))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls)
    # Round trip: the calls and their results go back through the template; a final answer.
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'})
    final = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=8,
        temperature=0,
    )
    assert final.choices[0].finish_reason == "length"
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # The history (calls and results) was rendered: the prompt grew by more than the calls.
    grown = final.usage.prompt_tokens - first.usage.prompt_tokens  # type: ignore[union-attr]
    assert grown > first.usage.completion_tokens  # type: ignore[union-attr]


def test_tools_reach_the_template(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="m", messages=MSG, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(
        model="m", messages=MSG, tools=TOOLS, max_tokens=1, temperature=0
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # type: ignore[union-attr]


THINKING = 'root ::= "<think>" [a-z]{3,6} "</think>" "\\n\\n" [a-z]{2,5}'


def test_reasoning_is_split_from_the_answer(client: openai.OpenAI) -> None:
    # The grammar makes even the random model think first: the parser must split it.
    reply = client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=1.0,
        seed=2,
        max_tokens=40,
        extra_body={"ebnf": THINKING},
    )
    msg = reply.choices[0].message
    reasoning = msg.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and reasoning.isalpha() and 3 <= len(reasoning) <= 6
    assert msg.content and msg.content.isalpha() and "<" not in msg.content
    # max_tokens counts the reasoning too.
    assert reply.usage is not None and reply.usage.completion_tokens >= 4
    stream = client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=1.0,
        seed=2,
        max_tokens=40,
        extra_body={"ebnf": THINKING},
        stream=True,
    )
    r = c = ""
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            r += getattr(d, "reasoning_content", None) or ""
            c += d.content or ""
    assert (r, c) == (reasoning, msg.content)
    cut = client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=1.0,
        seed=2,
        max_tokens=2,
        extra_body={"ebnf": THINKING},
    )
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.content


def test_thinking_off_is_all_answer(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m",
        messages=MSG,
        temperature=0,
        max_tokens=6,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    msg = reply.choices[0].message
    assert msg.content and getattr(msg, "reasoning_content", None) is None


def test_grammar_and_tool_calls_per_choice_with_n(client: openai.OpenAI) -> None:
    """n > 1: every sample walks its own grammar and its own tool-call parser."""
    pick = client.chat.completions.create(
        model="m",
        messages=MSG,
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=20,
        extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]},
    )
    assert [c.index for c in pick.choices] == [0, 1, 2]
    assert all(c.message.content in ("sunny", "rainy", "cloudy") for c in pick.choices)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    kwargs: dict[str, Any] = {
        "model": "m",
        "messages": messages,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": 21,
        "max_tokens": 200,
        "parallel_tool_calls": False,
        "n": 2,
    }
    whole = client.chat.completions.create(**kwargs)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in whole.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for c in whole.choices:
        mine = [
            ch.model_copy(update={"choices": [x for x in ch.choices if x.index == c.index]})
            for ch in chunks
        ]
        content, calls, reason = _reassemble(mine)
        assert reason == "tool_calls" and content == ""
        assert c.message.tool_calls is not None
        assert [(x["name"], x["arguments"]) for x in calls] == [
            (t.function.name, t.function.arguments) for t in c.message.tool_calls
        ]
