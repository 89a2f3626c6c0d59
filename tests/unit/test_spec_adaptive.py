"""Adaptive speculation (minisgl/speculative/adaptive.py): drafts per request from its recent
acceptance, speculation per step from the step costs the engine measured.

The simulations run a synthetic engine whose step costs T(n) = a + b*n (+ c when verifying)
and whose requests keep each draft with a fixed chance: what matters to a user is how long the
same output takes with the controller, with speculation always on, and without it."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence

import pytest

from minisgl.speculative.adaptive import (
    MAX_BACKOFF,
    MIN_BACKOFF,
    MIN_SLOPE_RATIO,
    PLAIN_REFRESH,
    PRIOR_SLOPE_RATIO,
    AdaptiveSpeculation,
    StepCostModel,
)

# A CPU-like cost: a step scoring 8 tokens costs ~1.45x one scoring 1.
CPU = (0.1, 0.0065, 0.0)


def trained(a: float, b: float, c: float, ns: range = range(1, 40)) -> StepCostModel:
    """A cost model fed noiseless timings at every n in `ns`, verifying, then plain."""
    model = StepCostModel()
    for verify in (True, False):
        for n in ns:
            model.observe(n, verify, a + b * n + (c if verify else 0.0))
    return model


# -- the step cost model ------------------------------------------------------------------


def test_cost_model_recovers_the_measured_coefficients() -> None:
    a, b, c = 0.05, 0.02, 0.01  # far from the prior's shape (b = 0.07 a, c = 0)
    model = StepCostModel()
    for _ in range(5):
        for n in (1, 8, 16, 32):
            for verify in (False, True):
                model.observe(n, verify, a + b * n + (c if verify else 0.0))
    fa, fb, fc = model.coefficients
    assert fa == pytest.approx(a, rel=0.1)
    assert fb == pytest.approx(b, rel=0.05)
    assert fc == pytest.approx(c, rel=0.2)  # the prior (c = 0) weighs one timing
    assert model.seconds(10, True) == pytest.approx(a + 10 * b + c, rel=0.05)


def test_with_one_batch_size_the_slope_is_the_priors() -> None:
    model = StepCostModel()
    for _ in range(50):
        model.observe(4, False, 0.2)
    a, b, _ = model.coefficients
    assert b / a == pytest.approx(PRIOR_SLOPE_RATIO, rel=0.01)
    assert model.seconds(4, False) == pytest.approx(0.2, rel=1e-6)


def test_before_any_timing_the_prior_shape_holds() -> None:
    a, b, c = StepCostModel().coefficients
    assert (a, b / a, c) == (1.0, PRIOR_SLOPE_RATIO, 0.0)


def test_cost_model_follows_a_change_of_load() -> None:
    model = trained(0.1, 0.01, 0.0)
    for _ in range(150):  # the machine got twice as slow
        for n in (1, 9):
            model.observe(n, False, 2 * (0.1 + 0.01 * n))
    assert model.seconds(1, False) == pytest.approx(2 * 0.11, rel=0.05)
    assert model.seconds(9, False) == pytest.approx(2 * 0.19, rel=0.05)


def test_cost_model_clamps_what_cannot_be() -> None:
    model = StepCostModel()
    for _ in range(20):  # verifying looked cheaper, more tokens looked cheaper: noise
        model.observe(1, False, 0.30)
        model.observe(16, True, 0.10)
    a, b, c = model.coefficients
    assert a > 0 and b >= MIN_SLOPE_RATIO * a * (1 - 1e-12) and c >= 0


@pytest.mark.parametrize("tokens,seconds", [(0, 0.1), (-1, 0.1), (1, 0.0), (1, float("nan"))])
def test_cost_model_refuses_bad_timings(tokens: int, seconds: float) -> None:
    with pytest.raises(ValueError, match="bad step timing"):
        StepCostModel().observe(tokens, False, seconds)


# -- acceptance per request ---------------------------------------------------------------


def test_acceptance_follows_recent_verifies() -> None:
    ctl = AdaptiveSpeculation(4)
    assert ctl.acceptance("r") == 0.25
    for _ in range(12):
        ctl.verified("r", 4, 0)
    low = ctl.acceptance("r")
    assert low < 0.1
    for _ in range(3):
        ctl.verified("r", 4, 4)
    now = ctl.acceptance("r")
    assert now > 0.5 > low  # recent verifies weigh most
    ctl.verified("r", 0, 0)  # no drafts: no news
    assert ctl.acceptance("r") == now


@pytest.mark.parametrize("proposed,accepted", [(2, 3), (2, -1)])
def test_verified_refuses_impossible_counts(proposed: int, accepted: int) -> None:
    with pytest.raises(ValueError):
        AdaptiveSpeculation(4).verified("r", proposed, accepted)


def test_max_draft_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError):
        AdaptiveSpeculation(0)


# -- plans ---------------------------------------------------------------------------------


def with_acceptance(ctl: AdaptiveSpeculation, key: str, kept: int, of: int, times: int) -> None:
    for _ in range(times):
        ctl.verified(key, of, kept)


def test_drafts_per_request_shrink_with_acceptance_and_grow_back_to_the_cap() -> None:
    ctl = AdaptiveSpeculation(6, trained(*CPU))
    plan = lambda: ctl.plan(["r"], [100], scored_tokens=1, emitted_tokens=1)  # noqa: E731
    with_acceptance(ctl, "r", 6, 6, 10)
    assert plan() == [6]
    seen = [6]
    while seen[-1] and len(seen) < 40:  # nothing kept any more
        ctl.verified("r", seen[-1], 0)
        seen.append(plan()[0])
    assert seen == sorted(seen, reverse=True) and seen[-1] == 0
    assert len(set(seen)) > 3  # one step at a time, not all or nothing
    grown = []
    for _ in range(8):  # the text turns into a copy again
        ctl.verified("r", max(1, grown[-1] if grown else 1), max(1, grown[-1] if grown else 1))
        grown.append(plan()[0])
    assert grown == sorted(grown) and grown[-1] == 6


def test_limits_cap_the_drafts() -> None:
    ctl = AdaptiveSpeculation(8, trained(*CPU))
    with_acceptance(ctl, "a", 8, 8, 10)
    with_acceptance(ctl, "b", 8, 8, 10)
    with_acceptance(ctl, "c", 8, 8, 10)
    assert ctl.plan(["a", "b", "c"], [0, 2, 50], scored_tokens=3, emitted_tokens=3) == [0, 2, 8]


def test_large_batches_run_without_drafts_at_the_measured_crossover() -> None:
    def drafts_at(batch: int, cost: tuple[float, float, float]) -> int:
        ctl = AdaptiveSpeculation(4, trained(*cost, ns=range(1, 300, 7)))
        keys = [f"r{i}" for i in range(batch)]
        for k in keys:
            with_acceptance(ctl, k, 2, 4, 6)  # half of the drafts kept
        ctl.plan(keys, [100] * batch, scored_tokens=batch, emitted_tokens=batch)  # new: probed
        return sum(ctl.plan(keys, [100] * batch, scored_tokens=batch, emitted_tokens=batch))

    assert drafts_at(1, CPU) > 0
    assert drafts_at(8, CPU) > 0
    assert drafts_at(256, CPU) == 0
    # Where speculation stops follows the measured slope, not a constant: with tokens ten
    # times cheaper (a GPU's weight-bound step) a batch of 64 still drafts.
    assert drafts_at(64, CPU) == 0
    assert drafts_at(64, (0.1, 0.00065, 0.0)) > 0
    # ... and a fixed cost of verifying raises the bar for a single stream.
    assert drafts_at(1, (0.1, 0.0065, 0.5)) == 0


def expected_rate(
    counts: tuple[int, ...],
    worths: list[list[float]],
    cost: StepCostModel,
    scored: int,
    emitted: int,
) -> float:
    gain = sum(sum(w[:n]) for w, n in zip(worths, counts))
    m = sum(counts)
    return (emitted + gain) / cost.seconds(scored + m, m > 0)


@pytest.mark.parametrize("cost", [CPU, (0.1, 0.03, 0.0), (0.1, 0.0065, 0.05), (0.1, 0.001, 0.2)])
@pytest.mark.parametrize("kept", [(0, 1, 2), (3, 3, 3), (0, 0, 3), (1, 2, 3)])
def test_plans_are_the_best_of_every_possible_plan(
    cost: tuple[float, float, float], kept: tuple[int, ...]
) -> None:
    """Exhaustively: no draft counts within the caps give more expected tokens per second."""
    model = trained(*cost)
    ctl = AdaptiveSpeculation(3, model)
    keys = ["a", "b", "c"]
    for key, k in zip(keys, kept):
        with_acceptance(ctl, key, k, 3, 5)
    caps = [3, 2, 3]
    worths = [ctl.worths(k, cap) for k, cap in zip(keys, caps)]
    for w in worths:  # a run's later drafts are worth less, each at most the chance before
        assert all(0 < y < x < 1 for x, y in itertools.pairwise(w))
    ctl.plan(keys, caps, scored_tokens=3, emitted_tokens=3)  # new requests are probed first
    for scored, emitted in ((3, 3), (40, 3)):  # decodes alone; beside a prefill chunk
        plan = ctl.plan(keys, caps, scored_tokens=scored, emitted_tokens=emitted)
        best = max(
            expected_rate(c, worths, model, scored, emitted)
            for c in itertools.product(*(range(cap + 1) for cap in caps))
        )
        got = expected_rate(tuple(plan), worths, model, scored, emitted)
        assert got == pytest.approx(best, rel=1e-9), (plan, worths)


def test_a_request_without_drafts_is_probed_at_growing_intervals() -> None:
    ctl = AdaptiveSpeculation(4, trained(*CPU))
    with_acceptance(ctl, "r", 0, 4, 30)
    probes = []
    for step in range(600):
        (k,) = ctl.plan(["r"], [100], scored_tokens=1, emitted_tokens=1)
        if k:
            assert k == 1
            probes.append(step)
            ctl.verified("r", 1, 0)  # nothing kept
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[0] == MIN_BACKOFF * 2 and gaps == sorted(gaps) and gaps[-1] == MAX_BACKOFF
    # A probe that is kept brings the drafts back at once.
    for _ in range(MAX_BACKOFF):
        if ctl.plan(["r"], [100], scored_tokens=1, emitted_tokens=1)[0]:
            break
    ctl.verified("r", 1, 1)
    ctl.verified("r", 1, 1)
    assert ctl.plan(["r"], [100], scored_tokens=1, emitted_tokens=1)[0] >= 1


def test_no_probe_where_a_draft_could_not_pay() -> None:
    ctl = AdaptiveSpeculation(4, trained(*CPU, ns=range(1, 300, 7)))
    keys = [f"r{i}" for i in range(128)]
    for k in keys:
        with_acceptance(ctl, k, 0, 4, 30)  # each is due for a probe, but a batch this big...
    for _ in range(2 * MIN_BACKOFF):
        assert sum(ctl.plan(keys, [100] * 128, scored_tokens=128, emitted_tokens=128)) == 0
    # ... at 8 they are probed.
    assert sum(ctl.plan(keys[:8], [100] * 8, scored_tokens=8, emitted_tokens=8)) == 8


def test_release_forgets_a_request() -> None:
    ctl = AdaptiveSpeculation(4)
    ctl.plan(["a", "b"], [4, 4], scored_tokens=2, emitted_tokens=2)
    ctl.verified("a", 4, 0)
    assert ctl.num_requests == 2
    ctl.release("a")
    ctl.release("b")
    ctl.release("never-seen")
    assert ctl.num_requests == 0
    assert ctl.acceptance("a") == 0.25


def test_plan_needs_a_limit_per_request() -> None:
    with pytest.raises(ValueError, match="one limit per request"):
        AdaptiveSpeculation(4).plan(["a"], [], scored_tokens=1, emitted_tokens=1)


# -- simulated workloads: the time the same output takes -----------------------------------


StepCost = tuple[float, float, float] | Callable[[int, int, int], float]


def simulate(
    policy: str,
    batch: int,
    true_alpha: float | Sequence[float],
    cost: StepCost,
    tokens: int,
    seed: int = 7,
) -> float:
    """Seconds until every request of the batch has `tokens` tokens: "plain" (no drafts),
    "always" (4 per request per step) or "adaptive". `true_alpha`: the chance each draft is
    kept, one for all or per request; `cost`: (a, b, c) of a step costing a + b*n (+ c when it
    verifies), or seconds(n scored, drafts, requests verifying)."""
    rng = random.Random(seed)
    if isinstance(cost, tuple):
        a, b, c = cost
        cost = lambda n, drafts, _: a + b * n + (c if drafts else 0.0)  # noqa: E731
    ctl = AdaptiveSpeculation(4)
    keys = [f"r{i}" for i in range(batch)]
    alphas = [true_alpha] * batch if isinstance(true_alpha, float) else list(true_alpha)
    chance = dict(zip(keys, alphas, strict=True))
    left = dict.fromkeys(keys, tokens)
    clock = 0.0
    while left:
        live = list(left)
        room = [left[k] - 1 for k in live]
        if policy == "plain":
            counts = [0] * len(live)
        elif policy == "always":
            counts = [min(4, r) for r in room]
        else:
            counts = ctl.plan(live, room, scored_tokens=len(live), emitted_tokens=len(live))
        drafts = sum(counts)
        seconds = cost(len(live) + drafts, drafts, sum(1 for k in counts if k))
        clock += seconds
        ctl.observe_step(len(live) + drafts, drafts, seconds)
        for key, k in zip(live, counts):
            kept = 0
            while kept < k and rng.random() < chance[key]:
                kept += 1
            if k:
                ctl.verified(key, k, kept)
            left[key] -= kept + 1
            if left[key] <= 0:
                del left[key]
                ctl.release(key)
    return clock


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("cost", [CPU, (0.1, 0.0065, 0.01)])
def test_nothing_to_accept_runs_within_5_percent_of_plain(
    batch: int, cost: tuple[float, float, float]
) -> None:
    plain = simulate("plain", batch, 0.0, cost, 256)
    assert simulate("adaptive", batch, 0.0, cost, 256) <= 1.05 * plain
    assert simulate("always", batch, 0.0, cost, 256) > 1.1 * plain  # what it saves


def test_a_copy_workload_gains_about_what_the_best_fixed_policy_gains() -> None:
    """Against the better of never and always drafting 4 (whichever that is for the batch and
    the acceptance), averaged over a few seeded runs: the controller's estimates are noisy, and
    a request starts sceptical (alpha 0.25), which costs a copy workload its first steps."""
    for batch, alpha in ((1, 0.9), (8, 0.9), (8, 0.5), (32, 0.8)):
        ratios = []
        for seed in range(3):
            plain = simulate("plain", batch, alpha, CPU, 128, seed)
            always = simulate("always", batch, alpha, CPU, 128, seed)
            ratios.append(simulate("adaptive", batch, alpha, CPU, 128, seed) / min(plain, always))
        assert sum(ratios) / len(ratios) <= 1.1, (batch, alpha, ratios)
    assert simulate("plain", 1, 0.9, CPU, 256) / simulate("adaptive", 1, 0.9, CPU, 256) > 2.5


def cpu_staircase(n: int, drafts: int, verifying: int) -> float:
    """A step's seconds shaped as this project's CPU kernels make them (2 cores, AVX2, bf16):
    the GEMV passes over the weights once per two rows up to 16, a GEMM then costs per row,
    and each request verifying drafts adds its extend attention and sampling. A plain step of
    8 costs 3.55x one of 1; 8 requests verifying 4 drafts each, 5.6x a plain step of 8."""
    gemv_passes = math.ceil(min(n, 16) / 2)
    return 0.15 + 0.85 * gemv_passes + 0.45 * max(0, n - 16) + 0.25 * verifying


def test_at_8_streams_drafts_that_cost_more_than_they_save_are_dropped() -> None:
    """Measured at 8 streams on the 2-core CPU: copying ran at 0.87x of plain decoding, the
    line a + b*n (+c) fitted across such a step's shape letting drafts through where the
    verify step cost more than it saved. With each step size's measured cost the controller
    keeps the batch of 8 plain: copying, copying with one stream whose text went its own way
    (its drafts all rejected: the last to finish), and nothing to accept; and one stream that
    copies still drafts (as many as always drafting 4, the best there)."""
    for alphas in ([0.95] * 8, [0.95] * 7 + [0.0], [0.0] * 8):
        plain = simulate("plain", 8, alphas, cpu_staircase, 128)
        adaptive = simulate("adaptive", 8, alphas, cpu_staircase, 128)
        assert adaptive <= 1.03 * plain, (alphas, plain / adaptive)
    plain = simulate("plain", 1, 0.95, cpu_staircase, 128)
    always = simulate("always", 1, 0.95, cpu_staircase, 128)
    adaptive = simulate("adaptive", 1, 0.95, cpu_staircase, 128)
    assert plain / always > 1.4 and adaptive <= 1.05 * always


def test_the_cost_of_each_measured_step_size_is_what_it_measured() -> None:
    model = StepCostModel()
    for _ in range(6):
        for batch in (1, 2, 8):
            model.observe(batch, False, cpu_staircase(batch, 0, 0))
            for k in (1, 4):
                n = batch * (k + 1)
                model.observe(n, True, cpu_staircase(n, batch * k, batch))
    for batch in (1, 2, 8):
        assert model.seconds(batch, False) == pytest.approx(cpu_staircase(batch, 0, 0), rel=0.03)
        n = 5 * batch
        assert model.seconds(n, True) == pytest.approx(cpu_staircase(n, 4 * batch, batch), rel=0.03)
    # Between measured sizes, in between; a plan's sweep over sizes says the same.
    assert model.seconds(16, True) < model.seconds(20, True) < model.seconds(40, True)
    for verify in (False, True):
        swept = model.seconds_from(1, 60, verify)
        assert swept == pytest.approx([model.seconds(n, verify) for n in range(1, 61)])
    # A size not timed for long fades back to the line.
    for _ in range(1000):
        model.observe(3, False, 1.0)
    assert model.seconds(40, True) == pytest.approx(model.line(40, True), rel=0.01)


def test_a_decode_batch_whose_plain_step_was_not_timed_runs_one_plain() -> None:
    ctl = AdaptiveSpeculation(4)
    with_acceptance(ctl, "r", 4, 4, 10)
    for _ in range(4):  # only verify steps timed: the plain step's cost is not known
        ctl.observe_step(5, 4, 0.2)
    assert ctl.plan(["r"], [100], scored_tokens=1, emitted_tokens=1) == [0]
    ctl.observe_step(1, 0, 0.1)
    assert ctl.plan(["r"], [100], scored_tokens=1, emitted_tokens=1) == [4]
    # Beside a prefill chunk (not timed: another regime) it is not held back.
    assert ctl.plan(["r"], [100], scored_tokens=300, emitted_tokens=1) != [0]
    for _ in range(PLAIN_REFRESH):
        ctl.observe_step(5, 4, 0.2)
    assert ctl.plan(["r"], [100], scored_tokens=1, emitted_tokens=1) == [4]
    ctl.observe_step(5, 4, 0.2)
    assert ctl.plan(["r"], [100], scored_tokens=1, emitted_tokens=1) == [0]  # refreshed


def test_without_adaptivity_every_request_gets_its_limit() -> None:
    """--disable-speculative-adaptive: all the drafts the limits allow, whatever the costs and
    the acceptance say (a big batch, requests whose drafts all failed)."""
    ctl = AdaptiveSpeculation(4, trained(*CPU, ns=range(1, 300, 7)), adaptive=False)
    for _ in range(20):
        ctl.verified("a", 4, 0)
    keys = ["a"] + [f"r{i}" for i in range(63)]
    limits = [9, 2, 0] + [4] * 61
    assert ctl.plan(keys, limits, scored_tokens=64, emitted_tokens=64) == [4, 2, 0] + [4] * 61
