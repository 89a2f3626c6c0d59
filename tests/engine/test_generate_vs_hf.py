"""Greedy generation must be token-identical to transformers on the same weights, for every
architecture of the registry (Qwen3, Qwen3-MoE, Qwen2, Llama 3)."""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from minisgl import LLM, SamplingParams

MAX_TOKENS = 12


# Each architecture's tiny fixture (see tests/conftest.py).
ARCH_FIXTURES = {
    "qwen3": "tiny_model_dir",
    "qwen3-moe": "moe_model_dir",
    "qwen2": "qwen2_model_dir",
    "llama": "llama_model_dir",
}


@lru_cache(maxsize=8)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """transformers' generate for one prompt (no padding), and its smallest top-1/top-2 margin."""
    model = _hf_model(model_dir)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    margin = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)
    return out.sequences[0, len(prompt) :].tolist(), margin


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 64, 100, 150, 300] + [rng.randint(1, 300) for _ in range(n)]
    return [[rng.randrange(0, 151643) for _ in range(length)] for length in lengths[:n]]


def check_identical(
    model_dir: str, llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate(prompts, params)
    smallest = float("inf")
    for prompt, out in zip(prompts, outs):
        want, margin = hf_greedy(model_dir, prompt, max_tokens)
        smallest = min(smallest, margin)
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == ("length" if len(want) == max_tokens else "stop")
    print(f"smallest top-1/top-2 logit margin: {smallest:.4f}")
    return smallest


# The same architectures as written by the installed transformers' save_pretrained, with its
# config.json keys (e.g. num_local_experts) rather than the project writer's.
SAVED_BY_TRANSFORMERS = {
    "qwen3": "transformers_qwen3_model_dir",
    "qwen3-moe": "transformers_moe_model_dir",
    "qwen2": "transformers_qwen2_model_dir",
    "llama": "transformers_llama_model_dir",
}


@pytest.fixture(scope="module", params=list(ARCH_FIXTURES))
def model_dir(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(ARCH_FIXTURES[request.param]))


def check_mixed_batch(model_dir: str, num_prompts: int = 12) -> None:
    llm = LLM(model_dir, dtype="float32", device="cpu", num_pages=512, page_size=16)
    # The registry picked the class config.json names, and transformers runs its own of it.
    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    assert type(llm.engine.runner.model).__name__ == arch == type(_hf_model(model_dir)).__name__
    margin = check_identical(model_dir, llm, mixed_prompts(num_prompts))
    assert margin > 1e-3, "logit margins too close to ties for an exact comparison"


def test_batch_of_mixed_lengths_matches_transformers(model_dir):
    check_mixed_batch(model_dir)


@pytest.mark.parametrize("arch", list(SAVED_BY_TRANSFORMERS))
def test_checkpoint_saved_by_transformers_matches(request: pytest.FixtureRequest, arch: str):
    # What differs from the project writer's checkpoints is how they are spelt, not what the
    # engine does with them: a smaller batch of mixed lengths suffices.
    check_mixed_batch(str(request.getfixturevalue(SAVED_BY_TRANSFORMERS[arch])), num_prompts=6)


def test_prefix_cache_off_matches(model_dir):
    llm = LLM(model_dir, dtype="float32", num_pages=512, disable_prefix_cache=True)
    check_identical(model_dir, llm, mixed_prompts(10, seed=1))
    assert llm.engine.stats().prefix_cache_hit_tokens_total == 0


def test_shared_long_prefix_reuses_pages_and_matches(model_dir):
    rng = random.Random(2)
    prefix = [rng.randrange(0, 151643) for _ in range(200)]
    prompts = [prefix + [rng.randrange(0, 151643) for _ in range(k)] for k in (5, 23)]
    llm = LLM(model_dir, dtype="float32", num_pages=256, page_size=16)
    check_identical(model_dir, llm, prompts[:1])
    check_identical(model_dir, llm, prompts)  # both now share the cached 192-token prefix
    assert llm.engine.stats().prefix_cache_hit_tokens_total >= 2 * 192


def test_chunked_prefill_matches(model_dir):
    llm = LLM(model_dir, dtype="float32", num_pages=512, max_prefill_tokens=32)
    check_identical(model_dir, llm, mixed_prompts(10, seed=3))


def test_preemption_under_page_pressure_matches(model_dir):
    # Two ~9-page prompts fit in 24 pages of 16 tokens, but not their next 48 tokens each.
    rng = random.Random(4)
    prompts = [[rng.randrange(0, 151643) for _ in range(rng.randint(130, 150))] for _ in range(10)]
    llm = LLM(model_dir, dtype="float32", num_pages=24, page_size=16)
    check_identical(model_dir, llm, prompts, max_tokens=48)
    assert llm.engine.stats().num_preemptions_total > 0


def test_text_prompts_and_stop_strings(model_dir, hf_tokenizer):
    llm = LLM(model_dir, dtype="float32", num_pages=256)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12))[
        0
    ]
    want, _ = hf_greedy(model_dir, [785, 6722, 315, 9625, 374], 12)
    assert out.token_ids == want
    assert out.text == hf_tokenizer.decode(want, skip_special_tokens=True)
    # Stop on a piece of the text we know will appear: it is cut, and generation ends there.
    stop = out.text[len(out.text) // 2 :][:3] or out.text
    cut = llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == out.text[: out.text.find(stop)]
    assert len(cut.token_ids) <= len(out.token_ids)
