"""`LLM.generate` and the server give the same text for the same request: one rule for what a
stop string or a stop token leaves in the output (vLLM's), on both paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import ServerProcess

from minisgl import LLM, SamplingParams

PROMPTS = ("Hello", "The weather", "1, 2, 3", "Dear friend")


def test_offline_and_served_outputs_are_identical(
    server: ServerProcess, tiny_model_dir: Path, hf_tokenizer: Any
) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=256)
    url = f"{server.url}/v1/completions"
    compared = 0
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        base: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
        free = llm.generate([ids], SamplingParams(**base))[0]
        text = free.text
        cases: list[dict[str, Any]] = [{"stop_token_ids": [free.token_ids[4]]}]
        if len(text) >= 6:
            cases.append({"stop": [text[len(text) // 2 : len(text) // 2 + 2]]})
        for case in cases:
            for include in (False, True):
                kw = {**base, **case, "include_stop_str_in_output": include}
                offline = llm.generate([ids], SamplingParams(**kw))[0]
                r = httpx.post(url, json={"prompt": ids, **kw}, timeout=60)
                assert r.status_code == 200, r.text
                served = r.json()["choices"][0]
                assert (served["text"], served["finish_reason"]) == (
                    offline.text,
                    offline.finish_reason,
                ), (prompt, kw)
                assert offline.finish_reason == "stop"
                compared += 1
        # The stop token's own text is shown only when asked for.
        stop_tok = free.token_ids[4]
        upto = free.token_ids[: free.token_ids.index(stop_tok)]
        kw = {**base, "stop_token_ids": [stop_tok]}
        assert llm.generate([ids], SamplingParams(**kw))[0].text == hf_tokenizer.decode(
            upto, skip_special_tokens=True
        )
    assert compared >= 2 * len(PROMPTS)
    server.wait_idle(within=10.0)


CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Hello there"}], {}),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour"},
        ],
        {"chat_template_kwargs": {"enable_thinking": False}},
    ),
    (
        [
            {"role": "user", "content": "Count to three"},
            {"role": "assistant", "content": "One, two"},
        ],
        {"continue_final_message": True, "add_generation_prompt": False},
    ),
    (
        [{"role": "user", "content": "Weather in Paris?"}],
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "description": "the weather of a city",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                        },
                    },
                }
            ]
        },
    ),
]


def test_offline_chat_matches_served_chat(server: ServerProcess, tiny_model_dir: Path) -> None:
    """LLM.chat renders the model's template as /v1/chat/completions does: the same prompt
    tokens (as /tokenize reports them), the same greedy reply; and it is generate() on the
    rendered prompt."""
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=256)
    base: dict[str, Any] = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
    params = SamplingParams(**base)
    for messages, extra in CONVERSATIONS:
        offline = llm.chat(messages, params, **extra)[0]
        r = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        assert offline.prompt_token_ids == r.json()["tokens"], extra
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": messages, **extra, **base},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        served = body["choices"][0]["message"]
        served_text = (served.get("reasoning_content") or "") + (served["content"] or "")
        assert body["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == len(offline.token_ids) == 10
        assert served_text == offline.text, extra
        assert offline.prompt is not None
        again = llm.generate([offline.prompt_token_ids], params)[0]
        assert (again.token_ids, again.text) == (offline.token_ids, offline.text)
    # A list of conversations: one output each, in order.
    both = llm.chat([CONVERSATIONS[0][0], CONVERSATIONS[1][0]], params)
    assert [o.token_ids for o in both] == [
        llm.chat(CONVERSATIONS[0][0], params)[0].token_ids,
        llm.chat(CONVERSATIONS[1][0], params)[0].token_ids,
    ]
    server.wait_idle(within=10.0)


def test_offline_chat_refuses_what_the_server_refuses(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=64)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="refused"):
        llm.chat(msgs, chat_template_kwargs={"chat_template": "{{ 'pwned' }}"})
    with pytest.raises(ValueError, match="refused"):
        llm.chat(msgs, chat_template="{{ 'pwned' }}")
    with pytest.raises(ValueError, match="renderer"):
        llm.chat(msgs, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="assistant"):
        llm.chat(msgs, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(
            [*msgs, {"role": "assistant", "content": "a"}],
            continue_final_message=True,
            add_generation_prompt=True,
        )
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(TypeError, match="conversation"):
        llm.chat({"role": "user", "content": "hi"})  # type: ignore[arg-type]
