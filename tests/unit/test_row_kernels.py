"""The per-row reductions of the sampler and of log-probabilities (C kernels on the CPU, torch
elsewhere) against torch's own max, log_softmax and topk."""

from __future__ import annotations

import pytest
import torch

from minisgl.layers import cpu_kernels
from minisgl.layers.logprobs import pick, row_stats, token_logprobs
from minisgl.layers.penalties import PenaltyBatch, PenaltyState, apply_penalties, undo_penalties
from minisgl.layers.sampling import row_max
from minisgl.sampling_params import SamplingParams

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no AVX2 kernels here")


@needs_kernels
@pytest.mark.parametrize("vocab", [1, 7, 8, 50, 151_936])
def test_argmax_is_torch_max(vocab: int) -> None:
    torch.manual_seed(vocab)
    x = torch.randn(5, vocab)
    top, best = cpu_kernels.rows_argmax(x)
    ref_top, ref_best = x.max(dim=-1)
    assert torch.equal(best, ref_best) and torch.equal(top, ref_top)


@needs_kernels
def test_argmax_ties_take_the_first_index_and_nan_poisons_the_row() -> None:
    x = torch.zeros(4, 40)
    x[0, [3, 11, 30]] = 2.0  # ties in different lanes and blocks
    x[1, [9, 1]] = 5.0  # the later lane holds the lower index
    x[2, 17] = float("nan")
    x[3] = float("-inf")
    top, best = cpu_kernels.rows_argmax(x)
    assert best[:2].tolist() == [3, 1]
    assert torch.isnan(top[2]) and top[3] == float("-inf")
    x[2, 38] = float("nan")  # in the scalar tail too
    assert torch.isnan(cpu_kernels.rows_argmax(x[:, :39].contiguous())[0][2])
    # The kernel keeps several running maxima (32 values a pass): ties between them, and
    # with the tail, still go to the first index.
    wide = torch.zeros(3, 100)
    wide[0, [72, 8, 33]] = 1.0
    wide[1, [97, 40, 64]] = 1.0
    wide[2, [99, 98]] = 1.0
    assert cpu_kernels.rows_argmax(wide)[1].tolist() == [8, 40, 98]


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_split_among_the_threads_gives_the_one_pass_answer(threads: int) -> None:
    """Fewer rows than threads: each row's vocabulary is split among them (a decode step of
    one request). The first index of the maximum wins across the parts, ties on a boundary
    included, and a NaN in any part poisons the row."""
    v = 151_936
    x = torch.randn(4, v)
    x[0, [100, 90_000]] = 9.0  # a tie across the halves: the first
    x[1, [v - 1, 75_968]] = 9.0  # at the end, and first in the second of two parts
    x[2, 140_000] = float("nan")  # in the last part; the row's best elsewhere
    x[3] = float("-inf")
    x[3, [5, 80_000]] = float("inf")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in ([0], [1], [2], [3], [0, 1], [2, 3], [0, 1, 2, 3]):
            top, best = cpu_kernels.rows_argmax(x[rows].contiguous())
            ref_top, ref_best = x[rows].max(dim=-1)
            finite = ~torch.isnan(ref_top)
            assert torch.equal(best[finite], ref_best[finite]), rows
            assert torch.equal(top[finite], ref_top[finite]) and torch.isnan(top[~finite]).all()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("vocab", [3, 29, 151_936])
def test_token_logprobs_match_log_softmax(
    kernels: bool, vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernels and cpu_kernels.load() is None:
        pytest.skip("no AVX2 kernels here")
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "rows_supported", lambda x: False)
    torch.manual_seed(vocab)
    x = torch.randn(6, vocab) * 4
    tokens = torch.randint(0, vocab, (6,))
    ks = [0, 1, 5, 20, 2, 20]
    got = token_logprobs(x, tokens, ks)
    ref = torch.log_softmax(x.double(), dim=-1)
    for r, k in enumerate(ks):
        assert got.token_ids[r] == int(tokens[r])
        assert got.logprobs[r] == pytest.approx(float(ref[r, tokens[r]]), abs=1e-5)
        k = min(k, vocab)
        values, ids = ref[r].topk(k)
        assert got.top_ids[r] == ids.tolist()
        assert got.top_logprobs[r] == pytest.approx(values.tolist(), abs=1e-5)


@needs_kernels
def test_top_k_ties_keep_the_lower_id_and_rows_are_read_in_place() -> None:
    x = torch.full((3, 64), -1.0)
    x[1, [40, 5, 22, 63]] = 3.0
    stats = row_stats(x, [1, 2], 3)
    assert stats.top_ids[0].tolist() == [5, 22, 40]
    assert stats.top_ids[1].tolist() == [0, 1, 2]
    expected = torch.logsumexp(x[1:].double(), dim=-1)
    assert torch.allclose(stats.lse.double(), expected, atol=1e-6)


def test_penalties_undone_leave_the_raw_logits_for_logprobs() -> None:
    torch.manual_seed(0)
    raw = torch.randn(2, 50)
    logits = raw.clone()
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, logit_bias={4: -100})
    state = PenaltyState.create(params, [1, 2, 3])
    state.catch_up([4, 4, 9])
    undo = apply_penalties(logits, PenaltyBatch.build([1], [params], [state], "cpu"))
    assert undo is not None and not torch.equal(logits, raw)
    stats = row_stats(raw, [1], 2)  # taken before the penalties, as the runner does
    undo_penalties(logits, undo)
    assert torch.equal(logits, raw)
    got = pick(logits, [1], stats, torch.tensor([4]), [2])
    assert got.logprobs[0] == pytest.approx(float(torch.log_softmax(raw[1], -1)[4]), abs=1e-6)


@needs_kernels
def test_row_max_uses_the_kernel_only_where_it_can() -> None:
    x = torch.randn(3, 100)
    assert torch.equal(row_max(x)[1], x.argmax(-1))
    t = x.t().contiguous().t()  # not contiguous: torch's path
    assert torch.equal(row_max(t)[1], x.argmax(-1))


@needs_kernels
@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat to peaked distributions
def test_nucleus_cutoff_keeps_what_the_sorted_prefix_keeps(scale: float) -> None:
    torch.manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(6, 30_000) * scale, dim=-1)
    top_p = torch.tensor([0.95, 0.5, 0.999, 1e-30, 1.0, 0.3])
    cutoff = cpu_kernels.nucleus_cutoff(probs, top_p)
    values, _ = probs.double().sort(dim=-1, descending=True)
    before = values.cumsum(dim=-1) - values
    for r in range(6):
        want = max(1, int((before[r] < top_p[r]).sum())) if top_p[r] < 1 else probs.shape[1]
        assert int((probs[r] >= cutoff[r]).sum()) == want, r


@needs_kernels
def test_sampled_filters_agree_with_and_without_the_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from minisgl.layers.sampling import SamplingBatch, filtered_probs

    torch.manual_seed(5)
    logits = torch.randn(5, 5000) * 2
    params = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.6, top_k=50),
        SamplingParams(temperature=0.7, top_k=7),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.2, top_p=0.99, min_p=0.01),
    ]
    batch = SamplingBatch.build(params, [0] * 5, list(range(5)), "cpu")
    fast = filtered_probs(logits, batch)
    monkeypatch.setattr(cpu_kernels, "rows_supported", lambda x: False)
    slow = filtered_probs(logits, batch)
    assert torch.equal(fast > 0, slow > 0)
    torch.testing.assert_close(fast, slow)


@needs_kernels
def test_a_wide_nucleus_beside_a_top_k_row_sorts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.layers.sampling import SamplingBatch, filtered_probs

    def no_sort(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the vocabulary was sorted")

    torch.manual_seed(3)
    logits = torch.randn(2, 20_000) * 0.1  # flat: the nucleus holds most of the vocabulary
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=5)]
    batch = SamplingBatch.build(params, [0, 0], [1, 2], "cpu")
    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    probs = filtered_probs(logits, batch)
    assert int((probs[0] > 0).sum()) > 10_000 and int((probs[1] > 0).sum()) == 5
