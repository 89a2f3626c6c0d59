"""What OpenAI-compatible clients expect beyond the basics: batched prompts, /tokenize and
/detokenize, max_completion_tokens, cached_tokens, continuous usage stats, ignored fields."""

from __future__ import annotations

import httpx
import openai
from harness import ServerProcess
from sse import stream_events

MSG = [{"role": "user", "content": "hi"}]


def test_batched_prompts_one_choice_each(client: openai.OpenAI) -> None:
    prompts = ["The sky is", "Once upon a time", "1 2 3"]
    singles = [
        client.completions.create(model="m", prompt=p, max_tokens=5, temperature=0).choices[0]
        for p in prompts
    ]
    batch = client.completions.create(model="m", prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [c.text for c in singles]
    assert batch.usage is not None and batch.usage.completion_tokens == 15
    ids = client.completions.create(
        model="m", prompt=[[785, 6722, 315], [9625, 374]], max_tokens=3, temperature=0
    )
    assert len(ids.choices) == 2
    stream = client.completions.create(
        model="m",
        prompt=prompts,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", "", ""]
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == [c.text for c in singles]
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 15


def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    r = httpx.post(
        f"{server.url}/tokenize",
        json={"model": "m", "prompt": "The capital of France is", "return_token_strs": True},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [785, 6722, 315, 9625, 374] and body["count"] == 5
    assert body["max_model_len"] == 4096 and body["token_strs"][0] == "The"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MSG}, timeout=30).json()
    assert chat["tokens"][0] == 151644  # <|im_start|>
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]}, timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": "The capital of France is"}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**7]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{server.url}/tokenize", json={"prompt": "a", "messages": MSG}, timeout=30)
    assert both.status_code == 400


def test_max_completion_tokens_user_metadata_and_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "word " * 100
    first = client.completions.create(
        model="m",
        prompt=prompt,
        temperature=0,
        user="u1",
        extra_body={"max_completion_tokens": 3, "metadata": {"k": "v"}},
    )
    assert first.usage is not None and first.usage.completion_tokens == 3
    again = client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
    details = again.usage.prompt_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.cached_tokens >= 64  # radix cache hits
    chat = client.chat.completions.create(
        model="m", messages=MSG, max_completion_tokens=2, metadata={"a": "b"}, user="u2"
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 2


def test_continuous_usage_stats(server: ServerProcess) -> None:
    body = {
        "messages": MSG,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = [e for e in stream_events(f"{server.url}/v1/chat/completions", body) if e != "[DONE]"]
    with_choices = [e for e in events if e["choices"]]
    assert with_choices and all(e["usage"] is not None for e in with_choices)
    assert with_choices[-1]["usage"]["completion_tokens"] == 4


def test_models_list_max_model_len(client: openai.OpenAI) -> None:
    card = client.models.list().data[0]
    assert card.model_dump()["max_model_len"] == 4096


def test_fields_we_cannot_honour_are_refused(server: ServerProcess) -> None:
    for field, value in (
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
    ):
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": MSG, "max_tokens": 1, field: value},
            timeout=30,
        )
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] in (field, "modalities")
    ok = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 1, "store": False, "service_tier": "auto"},
        timeout=30,
    )
    assert ok.status_code == 200


def test_batched_prompts_with_n_and_logprobs(client: openai.OpenAI) -> None:
    """A list of prompts with n: choice index = prompt * n + sample, sample i seeded seed + i
    (like one prompt with n), and each choice carries its own logprobs."""
    prompts = ["The sky is", "Once upon a time"]
    singles = [
        client.completions.create(
            model="m", prompt=p, n=2, max_tokens=5, temperature=1.0, seed=11
        ).choices
        for p in prompts
    ]
    batch = client.completions.create(
        model="m", prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=11, logprobs=1
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [c.text for s in singles for c in s]
    for c in batch.choices:
        assert c.logprobs is not None and c.logprobs.tokens
        assert c.logprobs.top_logprobs is not None and len(c.logprobs.top_logprobs[0]) >= 1
