"""Grammar-constrained decoding in the engine: outputs follow the grammar through chunked
prefill and preemption, and plain requests sharing the batch are untouched."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from minisgl import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "tags", "ok"],
    "additionalProperties": False,
}


def _json_params(seed: int, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        grammar_kind="json_schema",
        grammar=json.dumps(SCHEMA),
    )


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_plain_requests_are_unchanged_by_constrained_neighbours(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=512)
    prompts = _prompts(8, 5, 40, seed=1)
    plain = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=1.0, seed=7, max_tokens=12),
    ] * 4
    alone = llm.generate(prompts, plain)
    # Every other request constrained: the plain ones keep their tokens, greedy and seeded.
    mixed_params = [p for pair in zip(plain, [_json_params(i) for i in range(8)]) for p in pair]
    mixed_prompts = [p for pair in zip(prompts, prompts) for p in pair]
    mixed = llm.generate(mixed_prompts, mixed_params)
    assert [o.token_ids for o in mixed[0::2]] == [o.token_ids for o in alone]
    for out in mixed[1::2]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_grammar_survives_chunked_prefill_and_preemption(tiny_model_dir) -> None:
    # Long prompts in small chunks, and too few pages for all of them: requests are preempted
    # mid-output and recomputed; their matchers keep their place.
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_pages=24,
        page_size=16,
        max_prefill_tokens=32,
    )
    prompts = _prompts(8, 100, 140, seed=2)
    outs = llm.generate(prompts, [_json_params(i, max_tokens=80) for i in range(8)])
    assert llm.engine.stats().num_preemptions_total > 0
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # The same seeded requests without page pressure give the same tokens.
    roomy = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=512)
    again = roomy.generate(prompts, [_json_params(i, max_tokens=80) for i in range(8)])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_invalid_grammar_is_a_value_error_naming_the_field(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=64)
    with pytest.raises(ValueError, match="regex is invalid"):
        llm.generate([[1, 2, 3]], SamplingParams(grammar_kind="regex", grammar="(a"))
    with pytest.raises(ValueError, match="set together"):
        SamplingParams(grammar_kind="regex")


def test_grammar_with_ignore_eos_runs_on_unconstrained(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=64)
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, grammar_kind="choice", grammar='["yes"]'
    )
    out = llm.generate([[1, 2, 3]], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert out.text.startswith("yes")
