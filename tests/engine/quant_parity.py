"""Shared by the quantized-checkpoint tests: a float source checkpoint per preset (written once
per session), and greedy tokens through the engine with batching, chunked prefill and
prefix-cache hits, to compare a quantized checkpoint against its dequantized twin."""

from __future__ import annotations

import functools
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from minisgl import LLM, SamplingParams
from minisgl.layers import cpu_kernels
from minisgl.testing.fixture import write_fixture_model
from minisgl.testing.quant_writer import QuantFormat, write_quantized_pair

MAX_TOKENS = 8
needs_vnni_panel = pytest.mark.skipif(
    not (cpu_kernels.load() is not None and cpu_kernels.load().qvpanel),
    reason="no AVX512-VNNI build here: vnni_panel is never offered",
)
needs_amx_vpanel = pytest.mark.skipif(
    not (cpu_kernels.load() is not None and cpu_kernels.load().qvpanel_amx),
    reason="no AMX-INT8 here: amx_vpanel is never offered",
)
needs_fp8_panel = pytest.mark.skipif(
    not (cpu_kernels.load() is not None and "fp8" in cpu_kernels.load().qvpanel),
    reason="no AVX512-BF16 + AVX512-VBMI build here: fp8 panels are never offered",
)
# Every source checkpoint of this process lives here (80-160 MB each) and goes when the process
# ends: mkdtemp alone left them behind, run after run, until the disk was full.
_SOURCES = tempfile.TemporaryDirectory(prefix="minisgl-quant-sources-")
# A small prefill budget, so the longer prompts are prefilled in several chunks.
PREFILL_BUDGET = 32


@functools.cache
def source(preset: str, tied: bool = True) -> Path:
    """The float checkpoint of `preset` the quantized ones are made from (`tied`: its LM head
    is its embedding table)."""
    out = Path(_SOURCES.name) / f"{preset}-{'tied' if tied else 'untied'}"
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


def _run(engine, tag: str, params: SamplingParams) -> tuple[list[list[int]], list[list[float]]]:
    """Every prompt added at once (one batch; the long ones prefilled in chunks), stepped to
    the end: the generated ids per prompt, and per token the gap between its top two logprobs.
    Through the engine itself: the text (and so the tokenizer, seconds to load per instance)
    is not needed here."""
    todo = prompts()
    for i, ids in enumerate(todo):
        engine.add_request(f"{tag}-{i}", ids, params)
    out: list[list[int]] = [[] for _ in todo]
    gaps: list[list[float]] = [[] for _ in todo]
    while engine.has_unfinished():
        for step in engine.step():
            assert step.error is None, step.error
            i = int(step.rid.rsplit("-", 1)[1])
            out[i] += step.new_token_ids
            if step.logprobs is not None:
                gaps[i] += [top[0] - top[1] for top in step.logprobs.top_logprobs]
    return out, gaps


# In bf16 two candidates often (near-)tie: logits lie on a grid of 2^-6 .. 2^-4 at this model's
# magnitudes, and a few layers of bf16 rounding move them by ~0.1 (0.12 seen between the int4
# kernels and the bf16 twin's on one prompt). Another batch shape (a prefix-cache hit computes a
# prompt's last rows apart; kernels are picked by row count) or another weight format's kernels
# may break such a tie the other way, as in vLLM and SGLang; float32 runs compare exactly.
BF16_TIE = 0.25


def assert_agree(
    want: list[list[int]], got: list[list[int]], gaps: list[list[float]], dtype: str
) -> None:
    """`got` generates `want`'s tokens; in bf16, up to a tie of `want`'s top two candidates
    (`gaps`, want's run), after which the continuations differ by design."""
    if dtype != "bfloat16":
        assert got == want
        return
    for w, g, gap in zip(want, got, gaps, strict=True):
        j = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), None)
        assert j is None or gap[j] <= BF16_TIE, (j, w, g, gap)
    assert [len(g) for g in got] == [len(w) for w in want]


def greedy(path: Path, dtype: str = "float32", **kw) -> tuple[list[list[int]], list[list[float]]]:
    """Every prompt at once, then the same again (prefix-cache hits on all of them): the first
    run's tokens and their top-two gaps (see assert_agree)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    with LLM(
        str(path),
        dtype=dtype,
        num_pages=256,
        cpu_kernel_tuning="off",
        max_prefill_tokens=PREFILL_BUDGET,
        **kw,
    ) as llm:
        first, gaps = _run(llm.engine, "first", params)
        again, _ = _run(llm.engine, "again", params)
    assert_agree(first, again, gaps, dtype)
    return first, gaps


def assert_same_tokens(quant: Path, twin: Path, **kw) -> None:
    (ours, _), (reference, gaps) = greedy(quant, **kw), greedy(twin, **kw)
    assert_agree(reference, ours, gaps, kw.get("dtype", "float32"))
    assert all(len(t) == MAX_TOKENS for t in ours)


def transformers_greedy(
    path: Path, prepare: Callable[[Any], None] | None = None
) -> list[list[int]]:
    """transformers' greedy tokens for prompts() (EOS ignored, as greedy() does) in float32;
    `prepare(model)` runs first (e.g. to switch a quantizer's run-time rounding off)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if prepare is not None:
        prepare(model)
    out = []
    with torch.inference_mode():
        for prompt in prompts():
            ids = list(prompt)
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out
