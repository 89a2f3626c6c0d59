"""vLLM's min_tokens (and SGLang's min_new_tokens) served through the official openai client:
EOS, stop_token_ids and stop strings cannot end a reply before it, on both endpoints, streamed
or not, with n > 1 and grammars; a min_tokens no reply can reach is a 400."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from harness import ServerProcess

from minisgl.models.config import ModelConfig

MSG = [{"role": "user", "content": "Tell me about the sea."}]
THE = 785  # 'The' in the Qwen3 tokenizer


@pytest.fixture(scope="module")
def eos(tiny_model_dir: Path) -> list[int]:
    return list(ModelConfig.from_dir(tiny_model_dir).eos_token_ids)


def _bias(ids: list[int], value: float) -> dict[str, float]:
    return {str(t): value for t in ids}


def _ask(client: openai.OpenAI, kind: str, stream: bool, **kw: Any) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of a one-choice greedy request."""
    extra = kw.pop("extra_body", {})
    common: dict[str, Any] = {"model": "m", "temperature": 0, "extra_body": extra, **kw}
    if stream:
        common.update(stream=True, stream_options={"include_usage": True})
    if kind == "chat":
        reply: Any = client.chat.completions.create(messages=MSG, **common)  # type: ignore[arg-type]
    else:
        reply = client.completions.create(prompt="The sea is", **common)
    if not stream:
        c = reply.choices[0]
        text = c.message.content or "" if kind == "chat" else c.text
        return text, c.finish_reason, reply.usage.completion_tokens
    text, reason, tokens = "", "", -1
    for chunk in reply:
        for c in chunk.choices:
            text += (c.delta.content or "") if kind == "chat" else c.text
            reason = c.finish_reason or reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, reason, tokens


CASES = [("completions", False), ("completions", True), ("chat", False), ("chat", True)]


@pytest.mark.parametrize(("kind", "stream"), CASES)
def test_eos_cannot_end_the_reply_before_min_tokens(
    client: openai.OpenAI, eos: list[int], kind: str, stream: bool
) -> None:
    first = {"logit_bias": _bias(eos, 100.0)}  # every greedy pick would be EOS
    assert _ask(client, kind, stream, max_tokens=10, **first) == ("", "stop", 1)
    # The reply the model gives with EOS banned outright, cut at 4 tokens.
    banned, reason, _ = _ask(client, kind, False, max_tokens=4, logit_bias=_bias(eos, -100.0))
    assert reason == "length"
    # vLLM's field and SGLang's: 4 tokens of that reply, then EOS (a token, no text).
    field = "min_tokens" if stream else "min_new_tokens"
    got = _ask(client, kind, stream, max_tokens=10, extra_body={field: 4}, **first)
    assert got == (banned, "stop", 5)


def test_each_of_n_samples_holds_back_eos(client: openai.OpenAI, eos: list[int]) -> None:
    r = client.completions.create(
        model="m",
        prompt="The sea is",
        max_tokens=10,
        n=3,
        temperature=1.0,
        seed=7,
        logit_bias=_bias(eos, 100.0),  # type: ignore[arg-type]
        extra_body={"min_tokens": 3},
    )
    assert [c.finish_reason for c in r.choices] == ["stop"] * 3
    assert r.usage is not None and r.usage.completion_tokens == 3 * 4


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_and_stop_strings_wait_for_min_tokens(
    client: openai.OpenAI, stream: bool
) -> None:
    the = {"logit_bias": _bias([THE], 100.0)}  # greedy writes 'The' again and again
    stop_id = {"extra_body": {"stop_token_ids": [THE], "ignore_eos": True}}
    assert _ask(client, "completions", stream, max_tokens=8, **the, **stop_id) == ("", "stop", 1)
    held = {"extra_body": {"stop_token_ids": [THE], "ignore_eos": True, "min_tokens": 3}}
    text, reason, tokens = _ask(client, "completions", stream, max_tokens=8, **the, **held)
    assert reason == "stop" and tokens == 4 and "The" not in text  # 3 others, then 'The'
    strings = {"stop": ["The"], "extra_body": {"ignore_eos": True}}
    assert _ask(client, "completions", stream, max_tokens=8, **the, **strings) == ("", "stop", 1)
    # The first 3 tokens' text is never searched: the 4th 'The' is the stop string.
    strings["extra_body"]["min_tokens"] = 3
    got = _ask(client, "completions", stream, max_tokens=8, **the, **strings)
    assert got == ("TheTheThe", "stop", 4)


def test_a_grammar_that_can_only_end_wins(client: openai.OpenAI, eos: list[int]) -> None:
    # After 'yes' the regex allows nothing but EOS: the reply ends there, before min_tokens.
    # Where it allows more ('a+'), EOS waits for min_tokens.
    first = {"logit_bias": _bias(eos, 100.0), "max_tokens": 12}
    done = _ask(
        client, "completions", False, extra_body={"regex": "yes", "min_tokens": 10}, **first
    )
    assert done[:2] == ("yes", "stop") and done[2] < 10
    more = _ask(client, "completions", False, extra_body={"regex": "a+", "min_tokens": 6}, **first)
    assert set(more[0]) == {"a"} and more[1:] == ("stop", 7)
    # A named tool_choice: its call written (~30 tokens), only EOS is left.
    tool = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
    r = client.chat.completions.create(
        model="m",
        messages=MSG,  # type: ignore[arg-type]
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get"}},
        temperature=0,
        max_tokens=100,
        logit_bias=_bias(eos, 100.0),  # type: ignore[arg-type]
        extra_body={"min_tokens": 90},
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    assert c.message.tool_calls[0].function.name == "get"
    assert r.usage is not None and r.usage.completion_tokens < 90


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "min_tokens": 4}, "min_tokens",
         "min_tokens (4) must be at most max_tokens (3)"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 17}, "min_tokens",
         "min_tokens (17) must be at most max_tokens (16, the default)"),
        ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 2,
         "min_new_tokens": 5}, "min_new_tokens",
         "min_new_tokens (5) must be at most max_completion_tokens (2)"),
        ("/v1/chat/completions", {"messages": MSG, "min_tokens": 2, "min_new_tokens": 3},
         "min_new_tokens", "min_tokens (2) and min_new_tokens (3)"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens", ""),
        # No max_tokens: the context left after the prompt is the limit.
        ("/v1/chat/completions", {"messages": MSG, "min_tokens": 5000}, None,
         "plus min_tokens=5000"),
    ],
)  # fmt: skip
def test_a_min_tokens_no_reply_can_reach_is_a_400(
    server: ServerProcess, path: str, body: dict[str, Any], param: str | None, says: str
) -> None:
    for stream in (False, True):
        r = httpx.post(f"{server.url}{path}", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and says in error["message"], error
    assert server.wait_idle()["num_running"] == 0
