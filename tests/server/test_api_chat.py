"""Chat and completions through real HTTP: the openai client and raw SSE."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import openai
from harness import ServerProcess
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open
from sse import completion_text, stream_events

HELLO: Any = [{"role": "user", "content": "Say hello."}]


def test_chat_non_stream_with_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="any-name-works",
        messages=HELLO,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_stream_wire_format_and_usage(server: ServerProcess) -> None:
    body = {
        "model": "m",
        "messages": HELLO,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = stream_events(f"{server.url}/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len({c["id"] for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 6
    last = chunks[-2]["choices"][0]
    assert last["finish_reason"] == "length" and last["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])


def test_stream_equals_non_stream_with_openai_client(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "m",
        "messages": HELLO,
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kw).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kw)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == full and full


def test_cjk_and_emoji_are_streamed_whole(server: ServerProcess) -> None:
    """Random weights sample from the whole vocabulary, CJK and emoji included.

    A random model rarely samples the byte tokens of one character in order, so the split
    case itself is pinned in test_wire_and_detok.py with the real tokenizer and the worker's
    own Detokenizer; here the whole path must keep stream == non-stream on such text.
    """
    url = f"{server.url}/v1/completions"
    non_ascii = ""
    for seed in range(3):
        body = {"prompt": "你好", "max_tokens": 32, "temperature": 1.0, "seed": seed,
                "ignore_eos": True}  # fmt: skip
        full = httpx.post(url, json=body, timeout=60).json()
        text = full["choices"][0]["text"]
        events = stream_events(url, {**body, "stream": True})
        content = [c["choices"][0]["text"] for c in events[:-1] if c["choices"][0]["text"]]
        assert "".join(content) == text  # same seed, same tokens, same text
        if "\ufffd" not in text:
            assert all("\ufffd" not in c for c in content)
        non_ascii += "".join(ch for ch in text if ord(ch) > 0x2E80)
    assert non_ascii, "expected CJK or emoji in random-model output"


def test_completions_text_and_token_ids(server: ServerProcess, hf_tokenizer: Any) -> None:
    url = f"{server.url}/v1/completions"
    body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    a = httpx.post(url, json=body, timeout=60).json()
    ids = hf_tokenizer.encode("The capital of France is")
    b = httpx.post(url, json={**body, "prompt": ids}, timeout=60).json()
    assert a["object"] == "text_completion"
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] == len(ids)
    events = stream_events(url, {**body, "stream": True})
    assert completion_text(events) == a["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_cut_output_and_finish_with_stop(server: ServerProcess) -> None:
    url = f"{server.url}/v1/completions"
    base = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    text = httpx.post(url, json=base, timeout=60).json()["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    for stops in (stop, [stop, "never-appears"]):
        r = httpx.post(url, json={**base, "stop": stops}, timeout=60).json()
        assert r["choices"][0]["text"] == expected
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] < 24
        events = stream_events(url, {**base, "stop": stops, "stream": True})
        assert completion_text(events) == expected  # no partial stop string leaked
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
    server.wait_idle()  # the scheduler was told to stop generating


def test_stop_token_ids_end_generation(server: ServerProcess, hf_tokenizer: Any) -> None:
    url = f"{server.url}/v1/completions"

    def run(prompt: str, **kw: Any) -> dict[str, Any]:
        body = {"prompt": prompt, "temperature": 0, "ignore_eos": True, **kw}
        return httpx.post(url, json=body, timeout=60).json()

    for prompt in ("Hello", "The weather", "1, 2, 3", "Dear friend", "import os"):
        t1 = run(prompt, max_tokens=1)["choices"][0]["text"]
        t2 = run(prompt, max_tokens=2)["choices"][0]["text"]
        second = hf_tokenizer.encode(t2[len(t1) :]) if t2.startswith(t1) and t1 else []
        if len(second) == 1 and hf_tokenizer.decode(second) == t2[len(t1) :]:
            r = run(prompt, max_tokens=12, stop_token_ids=second)
            assert r["choices"][0]["finish_reason"] == "stop"
            assert r["usage"]["completion_tokens"] == 2  # the stop token counts...
            assert r["choices"][0]["text"] == t1  # ...but is not shown
            return
    raise AssertionError("no prompt gave a cleanly re-encodable second token")


def test_sampling_controls(server: ServerProcess) -> None:
    url = f"{server.url}/v1/completions"
    base: dict[str, Any] = {"prompt": "abc", "max_tokens": 8, "ignore_eos": True}

    def text(**kw: Any) -> str:
        r = httpx.post(url, json={**base, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert text(temperature=1.0, top_k=1) == greedy
    assert text(temperature=1.0, min_p=1.0) == greedy
    assert text(temperature=1e-40) == greedy  # no overflow to NaN: greedy, as in vLLM
    seeded = text(temperature=1.0, seed=42)
    assert text(temperature=1.0, seed=42) == seeded
    assert len({text(temperature=1.0, seed=s) for s in range(4)}) > 1
    r = httpx.post(url, json={**base, "max_tokens": 3}, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_and_chat_template_kwargs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m", messages=HELLO, max_completion_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 4
    think = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )  # fmt: skip
    no_think = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert think.usage is not None and no_think.usage is not None
    # Qwen3's template pre-fills an empty <think></think> block when thinking is off.
    assert no_think.usage.prompt_tokens > think.usage.prompt_tokens


def test_models_health_metrics(client: openai.OpenAI, server: ServerProcess) -> None:
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].id
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in ("minisgl_time_to_first_token_seconds", "minisgl_num_requests_running",
                 "minisgl_kv_cache_usage_ratio", "minisgl_requests_total"):  # fmt: skip
        assert name in metrics
    assert 'finish_reason="length"' in metrics


def test_metrics_say_the_weights_format_and_bytes(
    server: ServerProcess, tiny_model_dir: Path
) -> None:
    """/metrics' model info: the format (float weights here) and dtype in the info gauge's
    labels, and the weight bytes: every tensor of the checkpoint, in the server's dtype."""
    text = httpx.get(f"{server.url}/metrics").text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    info = samples["minisgl_model_info"]
    assert info.value == 1 and info.labels["quantization"] == "none"
    assert (info.labels["lm_head"], info.labels["activations"]) == ("none", "exact")
    assert info.labels["kv_cache"] == info.labels["dtype"]  # the default: the model's dtype
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[info.labels["dtype"]]
    numel = 0
    for f in sorted(tiny_model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            numel += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())  # noqa: SIM118
    assert samples["minisgl_model_weight_bytes"].value == numel * size
