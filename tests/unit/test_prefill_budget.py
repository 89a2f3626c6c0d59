"""A burst's prefill in chunks: which requests each step prefills (the scheduler's decisions as
a function of the queue and the soft budget), and the budget the measured step costs give."""

from __future__ import annotations

import pytest

from minisgl.sampling_params import SamplingParams
from minisgl.scheduler import Request, ScheduledBatch, Scheduler
from minisgl.scheduler.prefill_budget import OVERHEAD, PrefillBudget


def make(soft: int | None, max_prefill_tokens: int = 4096) -> Scheduler:
    s = Scheduler(
        num_pages=512,
        page_size=16,
        max_running_requests=64,
        max_prefill_tokens=max_prefill_tokens,
        max_seq_len=4096,
        eos_token_ids=[0],
    )
    s.soft_prefill_tokens = soft
    return s


def burst(s: Scheduler, n: int, prompt: int = 128, max_tokens: int = 16) -> list[Request]:
    reqs = [
        Request(
            f"r{i}",
            [1000 * (i + 1) + j for j in range(prompt)],
            SamplingParams(max_tokens=max_tokens),
        )
        for i in range(n)
    ]
    for r in reqs:
        s.add_request(r)
    return reqs


def run(s: Scheduler) -> tuple[list[ScheduledBatch], dict[str, int], dict[str, list[int]]]:
    """Every step until idle: the batches, each request's first-token step, and the steps in
    which it finished (a list, so that a second final reply would show)."""
    batches: list[ScheduledBatch] = []
    first: dict[str, int] = {}
    finished: dict[str, list[int]] = {}
    while (batch := s.schedule()) is not None:
        k = len(batches)
        batches.append(batch)
        tokens = [7] * batch.num_samples
        for seq in batch.seqs:
            if seq.sample:
                first.setdefault(seq.req.rid, k)
        for r in s.process_batch_output(batch, tokens):
            finished.setdefault(r.rid, []).append(k)
    return batches, first, finished


def test_a_burst_is_prefilled_a_few_requests_per_step_in_arrival_order() -> None:
    s = make(soft=256)
    reqs = burst(s, 8)
    batches, first, finished = run(s)
    # Two whole prompts a step: the first two have their first tokens after the first step,
    # before the last ones' prefill has even started.
    assert [[q.req.rid for q in b.seqs if not q.is_decode] for b in batches[:4]] == [
        ["r0", "r1"],
        ["r2", "r3"],
        ["r4", "r5"],
        ["r6", "r7"],
    ]
    assert [first[r.rid] for r in reqs] == [0, 0, 1, 1, 2, 2, 3, 3]
    # The prefilled ones decode beside the later prefills.
    assert [b.num_decode for b in batches[:4]] == [0, 2, 4, 6]
    # Every request ends with exactly one final reply, after its 16 tokens.
    assert all(len(finished[r.rid]) == 1 for r in reqs)
    assert all(len(r.output_ids) == 16 for r in reqs)


def test_without_a_soft_budget_a_burst_is_one_step() -> None:
    s = make(soft=None)
    reqs = burst(s, 8)
    batches, first, _ = run(s)
    assert batches[0].num_prefill_tokens == 8 * 128
    assert {first[r.rid] for r in reqs} == {0}


def test_a_lone_request_is_never_chunked_by_the_soft_budget() -> None:
    s = make(soft=64)
    (r,) = burst(s, 1, prompt=1000)
    batches, first, finished = run(s)
    assert batches[0].num_prefill_tokens == 1000
    assert first[r.rid] == 0 and len(finished[r.rid]) == 1


def test_the_request_that_crosses_the_soft_budget_joins_whole() -> None:
    s = make(soft=200)
    burst(s, 3, prompt=128)
    batch = s.schedule()
    assert batch is not None
    # 128 < 200: the second joins, and whole (256 tokens), never cut at 200.
    assert [len(q.token_ids) for q in batch.seqs] == [128, 128]


def test_the_hard_budget_still_cuts_a_long_prompt() -> None:
    s = make(soft=64, max_prefill_tokens=512)
    burst(s, 2, prompt=1000)
    batch = s.schedule()
    assert batch is not None
    assert [len(q.token_ids) for q in batch.seqs] == [512]


# ---- the budget from step timings -----------------------------------------------------------


def feed(budget: PrefillBudget, a: float, b: float, sizes: list[int]) -> None:
    for n in sizes:
        budget.observe(n, 0, a + b * n)


def test_no_budget_before_any_prefill_is_timed() -> None:
    budget = PrefillBudget(4096, 16)
    assert budget.tokens() is None
    budget.observe(0, 1, 0.05)  # decodes alone cannot tell a prefill token's cost
    assert budget.tokens() is None


def test_the_budget_keeps_a_steps_fixed_cost_within_the_overhead() -> None:
    budget = PrefillBudget(4096, 16)
    a, b = 0.06, 0.0006  # 60 ms a step, 0.6 ms a token
    feed(budget, a, b, [128, 1024, 256, 2048, 512])
    fit = budget.line()
    assert fit is not None
    assert fit[0] == pytest.approx(a) and fit[1] == pytest.approx(b)
    n = budget.tokens()
    assert n is not None
    assert a / (b * n) <= OVERHEAD < a / (b * (n - 1))


def test_compute_bound_prefill_gives_small_chunks_and_a_large_fixed_cost_large_ones() -> None:
    cpu, gpu = PrefillBudget(4096, 16), PrefillBudget(4096, 16)
    feed(cpu, 0.0005, 0.0007, [128, 1024, 512])  # no fixed cost to speak of
    feed(gpu, 0.010, 0.000001, [128, 1024, 512])  # launches and weights dwarf the arithmetic
    assert cpu.tokens() == 16
    assert gpu.tokens() == 4096


def test_prefills_of_one_size_take_the_fixed_cost_from_small_decode_steps() -> None:
    budget = PrefillBudget(4096, 16)
    feed(budget, 0.06, 0.0006, [128, 128, 128])
    assert budget.tokens() is None  # one size: a and b cannot be told apart, no decode yet
    budget.observe(0, 1, 0.06)
    a, b = budget.line() or (0.0, 0.0)
    assert a == pytest.approx(0.06) and b == pytest.approx(0.0006)


def test_the_fit_follows_a_change_of_speed() -> None:
    budget = PrefillBudget(4096, 16)
    feed(budget, 0.06, 0.0006, [128, 1024] * 20)
    feed(budget, 0.06, 0.0003, [128, 1024] * 60)  # twice as fast per token now
    fit = budget.line()
    assert fit is not None and fit[1] == pytest.approx(0.0003, rel=0.05)


def test_a_larger_overhead_allowed_gives_smaller_chunks() -> None:
    tight, loose = PrefillBudget(4096, 16, overhead=0.1), PrefillBudget(4096, 16, overhead=0.5)
    for budget in (tight, loose):
        feed(budget, 0.06, 0.0006, [128, 1024, 512])
    assert tight.tokens() == 1000 and loose.tokens() == 200
    with pytest.raises(ValueError):
        PrefillBudget(4096, 16, overhead=0.0)
