"""Shared by the quantized-checkpoint tests: a float source checkpoint per preset (written once
per session), and greedy tokens through the engine with batching, chunked prefill and
prefix-cache hits, to compare a quantized checkpoint against its dequantized twin."""

from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path

from minisgl import LLM, SamplingParams
from minisgl.testing.fixture import write_fixture_model
from minisgl.testing.quant_writer import QuantFormat, write_quantized_pair

MAX_TOKENS = 8
# A small prefill budget, so the longer prompts are prefilled in several chunks.
PREFILL_BUDGET = 32


@functools.cache
def source(preset: str, tied: bool = True) -> Path:
    """The float checkpoint of `preset` the quantized ones are made from (`tied`: its LM head
    is its embedding table)."""
    out = Path(tempfile.mkdtemp(prefix=f"minisgl-{preset}-"))
    return write_fixture_model(out, preset, tie_word_embeddings=tied)


def pair(preset: str, fmt: QuantFormat, tmp: Path, **kw) -> tuple[Path, Path]:
    quant, twin = tmp / "quantized", tmp / "twin"
    write_quantized_pair(source(preset), quant, twin, fmt, **kw)
    return quant, twin


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(0, 151643) for _ in range(40)]
    out = [[rng.randrange(0, 151643) for _ in range(rng.randint(1, 70))] for _ in range(4)]
    # Two prompts that share a 40-token prefix: the second of each run hits the prefix cache.
    return out + [shared + [7, 8], shared + [9]]


def _run(engine, tag: str, params: SamplingParams) -> list[list[int]]:
    """Every prompt added at once (one batch; the long ones prefilled in chunks), stepped to
    the end: the generated ids per prompt. Through the engine itself: the text (and so the
    tokenizer, seconds to load per instance) is not needed here."""
    todo = prompts()
    for i, ids in enumerate(todo):
        engine.add_request(f"{tag}-{i}", ids, params)
    out: list[list[int]] = [[] for _ in todo]
    while engine.has_unfinished():
        for step in engine.step():
            assert step.error is None, step.error
            out[int(step.rid.rsplit("-", 1)[1])] += step.new_token_ids
    return out


def greedy(path: Path, dtype: str = "float32", **kw) -> list[list[int]]:
    """Every prompt at once, then the same again (prefix-cache hits on all of them)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        str(path),
        dtype=dtype,
        num_pages=256,
        cpu_kernel_tuning="off",
        max_prefill_tokens=PREFILL_BUDGET,
        **kw,
    ) as llm:
        first = _run(llm.engine, "first", params)
        again = _run(llm.engine, "again", params)
    assert again == first
    return first


def assert_same_tokens(quant: Path, twin: Path, **kw) -> None:
    ours, reference = greedy(quant, **kw), greedy(twin, **kw)
    assert ours == reference
    assert all(len(t) == MAX_TOKENS for t in ours)
