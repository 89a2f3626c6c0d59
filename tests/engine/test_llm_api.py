"""The offline API as a user meets it: LLM(...).generate(...)."""

from __future__ import annotations

import random

import pytest

from minisgl import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=256)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def test_outputs_come_back_in_input_order(llm):
    prompts = _prompts(6)
    together = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5))
    alone = [llm.generate([p], SamplingParams(temperature=0, max_tokens=5))[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.prompt_token_ids for o in together] == prompts


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8)
    prompt = _prompts(1, seed=5)[0]
    alone = llm.generate([prompt], params)[0].token_ids
    crowd = _prompts(5, seed=6)
    mixed = llm.generate(
        [*crowd[:2], prompt, *crowd[2:]],
        [SamplingParams(temperature=0.8, max_tokens=8)] * 2
        + [params]
        + [SamplingParams(temperature=0.8, max_tokens=8)] * 3,
    )
    assert mixed[2].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=8)
    assert llm.generate([prompt], other_seed)[0].token_ids != alone


def test_unseeded_sampling_varies(llm):
    prompt = _prompts(1, seed=7)[0]
    params = SamplingParams(temperature=1.0, max_tokens=8)
    runs = {tuple(llm.generate([prompt], params)[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_stop_token_ids_and_ignore_eos(llm):
    prompt = _prompts(1, seed=8)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_at = free.token_ids[4]
    stopped = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at])
    )[0]
    first = free.token_ids.index(stop_at)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_eos_from_generation_config_is_a_list(llm):
    assert set(llm.engine.eos_token_ids) == {151645, 151643}


def test_context_limit(tiny_model_dir):
    small = LLM(str(tiny_model_dir), dtype="float32", num_pages=64, max_seq_len=32)
    out = small.generate([list(range(20))], SamplingParams(temperature=0, max_tokens=12))[0]
    assert len(out.token_ids) == 12
    with pytest.raises(ValueError, match="maximum context length is 32"):
        small.generate([list(range(30))], SamplingParams(max_tokens=12))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        small.generate([[10**7]], SamplingParams(max_tokens=2))


def test_untied_and_sharded_checkpoints_load(tiny_untied_model_dir, tiny_sharded_model_dir, llm):
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    sharded = LLM(str(tiny_sharded_model_dir), dtype="float32", num_pages=64)
    assert (
        sharded.generate([prompt], params)[0].token_ids
        == llm.generate([prompt], params)[0].token_ids
    )
    untied = LLM(str(tiny_untied_model_dir), dtype="float32", num_pages=64)
    assert len(untied.generate([prompt], params)[0].token_ids) == 6


def test_bfloat16_runs(tiny_model_dir):
    bf16 = LLM(str(tiny_model_dir), dtype="bfloat16", num_pages=64)
    out = bf16.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.token_ids) == 4 and isinstance(out.text, str)
