"""The engine asks the adaptive controller how many drafts each request gets: a request whose
drafts are kept gets up to K of them, one whose drafts keep failing soon gets none (but an
occasional probe); the controller sees every verify and every decode step's timing, and keeps
nothing of a request once it is gone.

The controller's step-cost fit is frozen here at a CPU-like shape (its own tests cover fitting
real timings): what this machine's load does to the timings must not decide the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.copy_model import write_copy_model
from minisgl.testing.frozen_cost import FrozenCost

K = 4
STARTS = (1000, 2000)
LENGTH = 40


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = write_copy_model(tiny_model_dir, tmp_path_factory.mktemp("adaptive") / "copy")
    return LLM(
        str(model),
        dtype="float32",
        num_pages=256,
        page_size=4,
        cpu_kernel_tuning="off",
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=K,
    )


def steps(llm: LLM, prompt: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """One request through the engine: its tokens, and (drafts, kept) of each decode step."""
    engine = llm.engine
    engine.add_request(
        "r", prompt, SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True)
    )
    tokens: list[int] = []
    per_step = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            per_step.append((out.spec_draft_tokens, out.spec_accepted_tokens))
    return tokens, per_step[1:]  # the first step prefilled


def test_drafts_follow_each_requests_acceptance(llm: LLM) -> None:
    engine = llm.engine
    assert engine.adaptive is not None
    cost = FrozenCost()
    engine.adaptive.cost = cost
    params = SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True)
    chains = [o.token_ids for o in llm.generate([[s] for s in STARTS], params)]

    # Copy: the prompt holds the model's own continuation; drafts are kept, and grow to K.
    copy_prompt = [STARTS[0], *chains[0], 7, STARTS[0]]
    tokens, copy_steps = steps(llm, copy_prompt)
    assert tokens == chains[0]
    drafted, kept = sum(d for d, _ in copy_steps), sum(k for _, k in copy_steps)
    assert kept == drafted > 0
    assert max(d for d, _ in copy_steps) == K
    assert len(copy_steps) < LENGTH / 2  # runs of kept drafts: fewer steps than tokens

    # Nothing to accept: each token of the continuation is followed by another in the prompt,
    # so every step has a draft, and none is kept. Drafts stop, but for rare one-token probes.
    rng_tokens = [3000 + i for i in range(LENGTH)]
    mixed = [t for c, x in zip(chains[1], rng_tokens, strict=True) for t in (c, x)]
    tokens, nothing_steps = steps(llm, [*mixed, STARTS[1]])
    assert tokens == chains[1]
    assert sum(k for _, k in nothing_steps) == 0
    assert nothing_steps[0][0] > 0  # it tried
    late = nothing_steps[len(nothing_steps) // 2 :]
    assert sum(d for d, _ in late) <= 3 and max(d for d, _ in late) <= 1

    # Every decode step's timing reached the controller, verifies as such; nothing is kept
    # of the finished requests.
    decode_steps = len(copy_steps) + len(nothing_steps)
    assert len(cost.seen) >= decode_steps
    verifies = sum(1 for d, _ in copy_steps + nothing_steps if d)
    assert sum(1 for _, verify, _ in cost.seen if verify) >= verifies
    assert all(n >= 1 and s > 0 for n, _, s in cost.seen)
    assert engine.adaptive.num_requests == 0
    assert engine.num_live_requests() == 0
