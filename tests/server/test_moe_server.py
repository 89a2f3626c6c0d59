"""`python -m minisgl --model <Qwen3-MoE>`: streams through the openai client, with metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
from harness import ServerProcess

from minisgl import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)


def test_moe_server_streams_the_offline_tokens(moe_model_dir, hf_tokenizer, tmp_path):
    messages = [{"role": "user", "content": "Name three prime numbers."}]
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = LLM(str(moe_model_dir), dtype="float32", num_pages=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )[0]
    server = ServerProcess(moe_model_dir, tmp_path / "moe.log", "--num-pages", "256")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="qwen3-moe",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "minisgl_generation_tokens_total" in metrics
        assert 'finish_reason="length"' in metrics
        server.wait_idle(within=30)
    finally:
        assert server.stop() == 0
