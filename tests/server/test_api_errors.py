"""Every malformed request is a 400 with an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from harness import ServerProcess

MSG: Any = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"

# (name, path, body: a dict is sent as JSON, bytes as they are)
MALFORMED: list[tuple[str, str, Any]] = [
    ("invalid json", CHAT, b'{"messages": [}'),
    ("empty body", CHAT, b""),
    ("json array body", CHAT, b"[1, 2]"),
    ("not utf-8", CHAT, b"\xff\xfe\x00"),
    ("missing messages", CHAT, {"model": "m"}),
    ("messages not a list", CHAT, {"messages": "hi"}),
    ("messages empty", CHAT, {"messages": []}),
    ("message without role", CHAT, {"messages": [{"content": "hi"}]}),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("content of wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}),
    ("image content", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("temperature not a number", CHAT, {"messages": MSG, "temperature": "hot"}),
    ("negative temperature", CHAT, {"messages": MSG, "temperature": -1}),
    ("top_p zero", CHAT, {"messages": MSG, "top_p": 0}),
    ("top_p above one", CHAT, {"messages": MSG, "top_p": 1.5}),
    ("top_k below -1", CHAT, {"messages": MSG, "top_k": -5}),
    ("min_p above one", CHAT, {"messages": MSG, "min_p": 2}),
    ("max_tokens zero", CHAT, {"messages": MSG, "max_tokens": 0}),
    ("max_tokens a string", CHAT, {"messages": MSG, "max_tokens": "many"}),
    ("max_completion_tokens negative", CHAT, {"messages": MSG, "max_completion_tokens": -3}),
    ("n above the server's --max-n", CHAT, {"messages": MSG, "n": 1000}),
    ("n zero", COMP, {"prompt": "hi", "n": 0}),
    ("stop of ints", CHAT, {"messages": MSG, "stop": [1, 2]}),
    ("empty stop string", CHAT, {"messages": MSG, "stop": ""}),
    ("negative stop token id", CHAT, {"messages": MSG, "stop_token_ids": [-1]}),
    ("stop token id beyond vocab", CHAT, {"messages": MSG, "stop_token_ids": [10**9]}),
    ("seed a float", CHAT, {"messages": MSG, "seed": 1.5}),
    ("seed too large", CHAT, {"messages": MSG, "seed": 2**70}),
    ("ignore_eos not a bool", CHAT, {"messages": MSG, "ignore_eos": "maybe"}),
    ("stream not a bool", CHAT, {"messages": MSG, "stream": "maybe"}),
    ("stream_options without stream", CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}),
    ("top_logprobs above 20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 3}),
    ("echo on chat", CHAT, {"messages": MSG, "echo": True}),
    ("completion logprobs above 20", COMP, {"prompt": "hi", "logprobs": 21}),
    ("prompt_logprobs (use echo)", COMP, {"prompt": "hi", "prompt_logprobs": 1}),
    ("presence_penalty above 2", CHAT, {"messages": MSG, "presence_penalty": 2.5}),
    ("frequency_penalty below -2", COMP, {"prompt": "hi", "frequency_penalty": -3}),
    ("repetition_penalty zero", COMP, {"prompt": "hi", "repetition_penalty": 0}),
    ("logit_bias key not a token id", CHAT, {"messages": MSG, "logit_bias": {"abc": 1}}),
    ("logit_bias beyond 100", CHAT, {"messages": MSG, "logit_bias": {"5": 101}}),
    ("logit_bias token beyond vocab", COMP, {"prompt": "hi", "logit_bias": {"999999999": 1}}),
    ("chat_template_kwargs not a dict", CHAT, {"messages": MSG, "chat_template_kwargs": [1]}),
    ("prompt plus max_tokens beyond context", CHAT, {"messages": MSG, "max_tokens": 10**6}),
    ("missing prompt", COMP, {"model": "m"}),
    ("empty prompt list", COMP, {"prompt": []}),
    ("empty prompt text", COMP, {"prompt": ""}),
    ("an empty prompt in a batch", COMP, {"prompt": [[1], []]}),
    ("token id beyond vocab", COMP, {"prompt": [1, 2, 10**7]}),
    ("negative token id", COMP, {"prompt": [1, -2]}),
    ("prompt of wrong type", COMP, {"prompt": {"text": "hi"}}),
    ("prompt too long for the context", COMP, {"prompt": [11] * 5000, "max_tokens": 1}),
    ("max_tokens zero without echo", COMP, {"prompt": "hi", "max_tokens": 0}),
]  # fmt: skip


def _post(server: ServerProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    url = server.url + path
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        return httpx.post(url, content=body, headers=headers, timeout=30, **kw)
    return httpx.post(url, json=body, timeout=30, **kw)


def _assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize(("name", "path", "body"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request_is_a_400(server: ServerProcess, name: str, path: str, body: Any) -> None:
    err = _assert_openai_error(_post(server, path, body), 400)
    assert err["type"] == "invalid_request_error"
    # The same with stream=true: still a plain 400, not a broken stream.
    if isinstance(body, dict) and "stream" not in name:
        _assert_openai_error(_post(server, path, {**body, "stream": True}), 400)


def test_invalid_json_says_where_and_names_no_param(server: ServerProcess) -> None:
    body = b'{"messages": [\n  {"role": "user", "content": "hi"},\n  }\n]}'
    err = _assert_openai_error(_post(server, CHAT, body), 400)
    assert err["param"] is None  # was "44": a character offset is no field
    assert "not valid JSON" in err["message"] and "line 3, column 3" in err["message"], err


def test_error_details_and_still_serving(server: ServerProcess, client: openai.OpenAI) -> None:
    assert len(MALFORMED) >= 20
    err = _assert_openai_error(_post(server, CHAT, {"messages": MSG, "temperature": "x"}), 400)
    assert err["param"] == "temperature"
    err = _assert_openai_error(_post(server, COMP, {"prompt": [1, 10**7]}), 400)
    assert "vocabulary" in err["message"]
    err = _assert_openai_error(_post(server, CHAT, {"messages": MSG, "max_tokens": 10**6}), 400)
    assert "context" in err["message"]
    _assert_openai_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=MSG, n=1000)  # type: ignore[arg-type]
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=2)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason in ("length", "stop")
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle()
