"""Batched sampling: greedy, seeded reproducibility, and the filters checked statistically."""

from __future__ import annotations

import pytest
import torch

from minisgl.layers.sampling import INVALID_TOKEN, SamplingBatch, filtered_probs, sample
from minisgl.sampling_params import SamplingParams

# A fixed distribution over 8 tokens: probabilities 0.30 0.20 0.15 0.12 0.10 0.07 0.04 0.02.
PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
LOGITS = PROBS.log()
DRAWS = 4000


def draw(params: SamplingParams, n: int = DRAWS, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """n tokens from n rows (distinct seeds) of the same logits."""
    batch = SamplingBatch.build([params] * n, [0] * n, list(range(n)), "cpu")
    return sample(logits.expand(n, -1).contiguous(), batch)


def assert_follows(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Pearson chi-square against `expected` (zeros must never be drawn)."""
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    assert counts[expected == 0].sum() == 0, f"drew a filtered-out token: {counts}"
    keep = expected > 0
    exp_counts = expected[keep].double() * len(tokens)
    chi2 = float(((counts[keep] - exp_counts) ** 2 / exp_counts).sum())
    # 99.9th percentile of chi-square with up to 7 degrees of freedom is 24.3.
    assert chi2 < 24.3, f"chi2={chi2:.1f} counts={counts.tolist()} expected={exp_counts.tolist()}"


def renorm(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum()


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50)
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 5, [0] * 5, [1] * 5, "cpu")
    assert batch.all_greedy
    assert torch.equal(sample(logits, batch), logits.argmax(-1))


def test_an_all_greedy_batch_hashes_no_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a random draw reads the (seed, step) keys: a greedy decode step does not pay the
    ~40 small torch ops that make them."""
    from minisgl.layers import sampling

    def refuse(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a greedy batch hashed its seeds")

    monkeypatch.setattr(sampling, "_hash32", refuse)
    logits = torch.randn(3, 50)
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 3, [4] * 3, [1, 2, 3], "cpu")
    assert torch.equal(sample(logits, batch), logits.argmax(-1))


def test_an_all_greedy_batch_makes_no_per_row_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy decode step builds no tensor of temperatures or greedy flags: each is a few
    torch ops, on caches the step's matmuls streamed out."""
    made: list[object] = []
    real = torch.tensor

    def counted(*a: object, **kw: object) -> torch.Tensor:
        made.append(a[0])
        return real(*a, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "tensor", counted)
    logits = torch.randn(3, 50)
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 3, [4] * 3, [1, 2, 3], "cpu")
    assert torch.equal(sample(logits, batch), logits.argmax(-1))
    assert made == []


def test_greedy_rows_stay_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=1)] * 1
    params.append(SamplingParams(temperature=0))
    out = sample(logits, SamplingBatch.build(params, [0, 0, 0, 3], [1, 2, 3, 4], "cpu"))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out[3] == logits[3].argmax()


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    p = SamplingParams(temperature=1.0, top_p=0.9)
    seeds, steps = [11, 12, 13, 14, 15, 16], [0, 5, 2, 2, 9, 1]
    together = sample(logits, SamplingBatch.build([p] * 6, steps, seeds, "cpu"))
    for i in range(6):
        alone = sample(logits[i : i + 1], SamplingBatch.build([p], [steps[i]], [seeds[i]], "cpu"))
        assert alone.item() == together[i].item()
    # Another batch order and other neighbours: same per-request tokens.
    perm = [5, 3, 1, 0, 2, 4]
    shuffled = sample(
        logits[perm],
        SamplingBatch.build([p] * 6, [steps[i] for i in perm], [seeds[i] for i in perm], "cpu"),
    )
    assert shuffled.tolist() == together[perm].tolist()


def test_seed_and_step_change_the_draw() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any two draws agree with probability 1/1000
    p = SamplingParams()
    tokens = {
        sample(logits, SamplingBatch.build([p], [step], [seed], "cpu")).item()
        for seed in range(5)
        for step in range(5)
    }
    assert len(tokens) > 15
    # Seeds beyond 32 bits: the high bits count too.
    high = {
        sample(logits, SamplingBatch.build([p], [0], [3 + (i << 32)], "cpu")).item()
        for i in range(10)
    }
    assert len(high) > 5


def test_plain_sampling_follows_the_distribution() -> None:
    assert_follows(draw(SamplingParams(temperature=1.0)), PROBS)


def test_temperature() -> None:
    for t in (0.5, 2.0):
        assert_follows(draw(SamplingParams(temperature=t)), renorm(PROBS ** (1 / t)))


def test_top_k() -> None:
    expected = renorm(torch.where(torch.arange(8) < 3, PROBS, 0.0))
    assert_follows(draw(SamplingParams(top_k=3)), expected)


def test_top_p() -> None:
    # 0.30 + 0.20 = 0.50 < 0.6, so the third token (0.15) is needed to reach 0.6.
    expected = renorm(torch.where(torch.arange(8) < 3, PROBS, 0.0))
    assert_follows(draw(SamplingParams(top_p=0.6)), expected)
    # Exactly reaching the mass stops there: 0.30 + 0.20 >= 0.5.
    expected = renorm(torch.where(torch.arange(8) < 2, PROBS, 0.0))
    assert_follows(draw(SamplingParams(top_p=0.5)), expected)


def test_min_p() -> None:
    # Keep tokens with p >= 0.45 * 0.30 = 0.135.
    expected = renorm(torch.where(PROBS >= 0.135, PROBS, 0.0))
    assert_follows(draw(SamplingParams(min_p=0.45)), expected)


def test_filters_combine_per_row() -> None:
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.6),
        SamplingParams(temperature=0.5),
        SamplingParams(),
    ]
    batch = SamplingBatch.build(params, [0] * 5, [0] * 5, "cpu")
    probs = filtered_probs(LOGITS.expand(5, -1).contiguous(), batch)
    assert (probs[0] > 0).sum() == 2 and (probs[1] > 0).sum() == 3 and (probs[2] > 0).sum() == 2
    torch.testing.assert_close(probs[3], renorm(PROBS**2))
    torch.testing.assert_close(probs[4], PROBS)


def test_build_on_large_vocab_is_fast_enough() -> None:
    # The Qwen3 vocabulary: a full-vocab draw for a small batch stays cheap.
    import time

    logits = torch.randn(4, 151936)
    batch = SamplingBatch.build([SamplingParams(top_p=0.9, top_k=50)] * 4, [0] * 4, [1] * 4, "cpu")
    sample(logits, batch)
    start = time.perf_counter()
    out = sample(logits, batch)
    assert time.perf_counter() - start < 1.0
    assert out.shape == (4,) and out.dtype == torch.long


def test_tiny_temperatures_are_greedy() -> None:
    # 1e-40 is 0 or subnormal in float32: dividing the logits by it overflowed to NaN and the
    # sampler returned the last id of the vocabulary.
    torch.manual_seed(1)
    logits = torch.randn(3, 50) * 10
    for t in (1e-40, 1e-6):
        params = SamplingParams(temperature=t, top_p=0.9)
        assert params.greedy
        out = sample(logits, SamplingBatch.build([params] * 3, [0] * 3, [1, 2, 3], "cpu"))
        assert torch.equal(out, logits.argmax(-1)), t
    assert not SamplingParams(temperature=1e-4).greedy


def test_rows_without_a_distribution_are_invalid_never_a_token() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    logits[0, 3] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")
    logits[3, :10] = float("-inf")  # masked tokens are fine: a distribution remains
    for params in (
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=5),
        SamplingParams(temperature=1.0, min_p=0.1),
    ):
        out = sample(logits, SamplingBatch.build([params] * 4, [0] * 4, [1, 2, 3, 4], "cpu"))
        assert out[:3].tolist() == [INVALID_TOKEN] * 3, params
        assert 10 <= int(out[3]) < 50, params
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2
    out = sample(logits, SamplingBatch.build(mixed, [0] * 4, [1, 2, 3, 4], "cpu"))
    assert out[:3].tolist() == [INVALID_TOKEN] * 3 and 10 <= int(out[3]) < 50


def test_top_p_that_rounds_to_zero_keeps_the_best_token() -> None:
    # top_p=5e-324 passes the API's "> 0" check but is 0 in float32: nothing was kept, the row
    # had no distribution and the request ended with a 500 (found by schemathesis).
    for top_p in (5e-324, 1e-45):
        tokens = draw(SamplingParams(temperature=1.0, top_p=top_p), n=64)
        assert tokens.tolist() == [0] * 64, top_p
