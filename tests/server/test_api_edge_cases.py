"""Edge cases of the served API found by exploring it as a vLLM/SGLang user would.

A Qwen3 Thinking-2507 chat template opens the think block in the generation prompt
(`<|im_start|>assistant\\n<think>\\n`): the output is reasoning up to `</think>`, then the
answer, as vLLM's and SGLang's qwen3 reasoning parsers split it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from harness import ServerProcess

pytestmark = pytest.mark.timeout(300)

MSG = [{"role": "user", "content": "hi"}]
# What a Thinking-2507 model writes after its prompt's `<think>\n`: reasoning, the closing
# tag, the answer.
CLOSES_THINK = 'root ::= [a-z]{3,6} "</think>" "\\n\\n" [a-z]{2,5}'
LONG_THOUGHT = 'root ::= [a-z]{8,12} "</think>" [a-z]{2}'
HYBRID_PROMPT = """    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}"""
THINKING_2507_PROMPT = "    {{- '<|im_start|>assistant\\n<think>\\n' }}"


def _thinking_2507(src: Path, out: Path) -> Path:
    """The fixture model with Qwen3-Thinking-2507's generation prompt (which has no
    enable_thinking switch: the model always thinks)."""
    shutil.copytree(src, out)
    jinja = out / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8")
    assert HYBRID_PROMPT in template
    template = template.replace(HYBRID_PROMPT, THINKING_2507_PROMPT)
    assert "enable_thinking" not in template
    jinja.write_text(template, encoding="utf-8")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def thinking_client(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    model = _thinking_2507(tiny_model_dir, tmp_path_factory.mktemp("t2507") / "model")
    log = tmp_path_factory.mktemp("t2507-server") / "server.log"
    srv = ServerProcess(model, log, "--num-pages", "256", "--log-level", "info").wait_ready()
    try:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        srv.stop()


def test_a_prompt_that_opens_the_think_block_splits_at_its_close(
    thinking_client: openai.OpenAI,
) -> None:
    kwargs = {"model": "m", "messages": MSG, "max_tokens": 40, "seed": 3}
    reply = thinking_client.chat.completions.create(**kwargs, extra_body={"ebnf": CLOSES_THINK})
    msg = reply.choices[0].message
    reasoning = msg.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and reasoning.isalpha() and 3 <= len(reasoning) <= 6
    assert msg.content and msg.content.isalpha() and 2 <= len(msg.content) <= 5
    stream = thinking_client.chat.completions.create(
        **kwargs, extra_body={"ebnf": CLOSES_THINK}, stream=True
    )
    streamed_reasoning = streamed_content = ""
    for chunk in stream:
        for choice in chunk.choices:
            streamed_reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            streamed_content += choice.delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, msg.content)


def test_a_constrained_output_is_the_answer_even_after_an_open_think_block(
    thinking_client: openai.OpenAI,
) -> None:
    """A grammar applies from the first token (docs/serving.md): what it makes is the answer
    (or the tool call), not reasoning, though the prompt opened the block."""
    reply = thinking_client.chat.completions.create(
        model="m",
        messages=MSG,
        max_tokens=30,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "string", "maxLength": 3}}, "required": ["a"]}},
        },
    )  # fmt: skip
    msg = reply.choices[0].message
    assert json.loads(msg.content or "").keys() == {"a"}
    assert msg.reasoning_content is None  # type: ignore[attr-defined]
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    called = thinking_client.chat.completions.create(
        model="m", messages=MSG, max_tokens=60, tools=[tool], tool_choice="required"
    )
    calls = called.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "now"


def test_a_cut_off_thought_is_all_reasoning(thinking_client: openai.OpenAI) -> None:
    reply = thinking_client.chat.completions.create(
        model="m", messages=MSG, max_tokens=2, extra_body={"ebnf": LONG_THOUGHT}
    )
    msg = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length"
    assert msg.reasoning_content and not msg.content  # type: ignore[attr-defined]


# A template whose switch turns the prefilled think block off (as Qwen3.5's does).
SWITCHED = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


def test_which_templates_prefill_the_think_block(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from minisgl.tokenizer.chat_render import prefilled_think

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # Qwen3's hybrid template: the model opens its own block; false pre-fills a closed one.
    assert prefilled_think(tokenizer) == {"unset": False, "true": False, "false": False}
    tokenizer.chat_template = SWITCHED
    assert prefilled_think(tokenizer) == {"unset": True, "true": True, "false": False}
    tokenizer.chat_template = None  # a base model: no chat template renders
    assert prefilled_think(tokenizer) == {"unset": False, "true": False, "false": False}


# vLLM's chat fields for continuing a partial assistant message (a prefill the model goes on
# from) instead of starting a new turn.
PARTIAL = [
    {"role": "user", "content": "Count to five."},
    {"role": "assistant", "content": "One, two,"},
]


def _tokenize(server: ServerProcess, body: dict) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _ends_the_prompt_with(hf_tokenizer: Any, ids: list[int], text: str) -> bool:
    return hf_tokenizer.decode(ids).endswith(text)


def test_continue_final_message_prompts_the_partial_answer(
    server: ServerProcess, hf_tokenizer: Any
) -> None:
    continued = _tokenize(server, {"messages": PARTIAL, "continue_final_message": True})
    assert _ends_the_prompt_with(hf_tokenizer, continued, "One, two,")
    want = hf_tokenizer.apply_chat_template(
        PARTIAL, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert hf_tokenizer.decode(continued) == want
    for extra in (
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"chat_template_kwargs": {"continue_final_message": True}},
    ):
        body = {"model": "m", "messages": PARTIAL, "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["usage"]["prompt_tokens"] == len(continued), extra
    # Without the fields the partial message is a closed turn and a new one starts.
    fresh = _tokenize(server, {"messages": PARTIAL})
    assert _ends_the_prompt_with(hf_tokenizer, fresh, "<|im_start|>assistant\n")
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "m", "messages": PARTIAL, "max_tokens": 1, "add_generation_prompt": False},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(fresh) - 3


def test_continue_final_message_conflicts_are_400s(server: ServerProcess) -> None:
    cases = [
        ({"continue_final_message": True, "add_generation_prompt": True}, PARTIAL),
        ({"chat_template_kwargs": {"continue_final_message": True}, "add_generation_prompt": True},
         PARTIAL),
        ({"continue_final_message": True}, PARTIAL[:1]),  # nothing of the assistant's to go on
    ]  # fmt: skip
    for extra, messages in cases:
        body = {"model": "m", "messages": messages, "max_tokens": 2, **extra}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] in ("continue_final_message", "messages"), error
    assert server.wait_idle()["num_running"] == 0


def test_an_invalid_grammar_is_named_by_the_field_that_gave_it(server: ServerProcess) -> None:
    """The scheduler compiles a grammar knowing only its kind; the 400 names the request's
    own field (a tool's parameters are no response_format)."""
    bad_schema = {"type": "object", "properties": {"a": {"type": "bogus"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": bad_schema}}
    chat = {"model": "m", "messages": MSG, "max_tokens": 2}
    cases = [
        ("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}, "tools"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": bad_schema},
         "guided_json"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_regex": "("},
         "guided_regex"),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "guided_grammar": "x ::="},
         "guided_grammar"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "regex": "("}, "regex"),
        ("/v1/chat/completions",
         {**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": bad_schema}}},
         "response_format"),
    ]  # fmt: skip
    for path, body, field in cases:
        for stream in (False, True):
            r = httpx.post(f"{server.url}{path}", json={**body, "stream": stream}, timeout=120)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == field, (body, error)
            assert error["message"].startswith(f"{field} is invalid: "), (body, error)
    assert server.wait_idle()["num_running"] == 0


# vLLM sampling extras that change what is generated: served as if absent they would give a
# different answer than asked (vLLM honours them), so they are refused. Their defaults pass.
CHANGES_THE_OUTPUT = [
    ("bad_words", ["the"], []),
    ("allowed_token_ids", [1, 2, 3], None),
    ("use_beam_search", True, False),
    ("truncate_prompt_tokens", 8, None),
    ("return_tokens_as_token_ids", True, False),
]


@pytest.mark.parametrize(("field", "value", "default"), CHANGES_THE_OUTPUT)
def test_vllm_extras_we_do_not_honour_are_refused(
    server: ServerProcess, field: str, value: object, default: object
) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 1}),
    ):
        r = httpx.post(f"{server.url}{path}", json={**body, field: value}, timeout=30)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field
        ok = httpx.post(f"{server.url}{path}", json={**body, field: default}, timeout=30)
        assert ok.status_code == 200, (field, ok.text)


@pytest.mark.parametrize(
    ("content", "content_type", "says"),
    [
        (b'{"prompt": "hi"}', None, "Content-Type: application/json"),
        (
            b'{"prompt": "hi"}',
            "application/x-www-form-urlencoded",
            "Content-Type: application/json",
        ),
        (b"", "application/json", "empty"),
        (b"[1, 2]", "application/json", "must be a JSON object"),
        (b"null", "application/json", "must be a JSON object"),
    ],
)
def test_a_body_that_is_no_json_object_says_why(
    server: ServerProcess, content: bytes, content_type: str | None, says: str
) -> None:
    """`curl -d` sends form-urlencoded and some clients no content type at all: the 400 says
    what to fix, not that the input 'should be a valid dictionary'."""
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{server.url}/v1/completions", content=content, headers=headers, timeout=30)
    assert r.status_code == 400
    assert says in r.json()["error"]["message"], r.text
