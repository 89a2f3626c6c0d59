"""Draft verification: the kept run, the target's distribution unchanged (chi-square over many
seeded draws on a six-token vocabulary), and each position drawn as a plain step draws it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from minisgl.layers.sampling import SamplingBatch, filtered_probs, sample
from minisgl.sampling_params import SamplingParams
from minisgl.speculative.verify import accept_run, expand_states, split_runs, verify

VOCAB = 6
DRAWS = 6000
# Chi-square critical value for 5 degrees of freedom at p = 0.001: a correct sampler fails
# one run in a thousand.
CHI2_CRIT_DF5 = 20.52


def test_accept_run_keeps_the_agreeing_prefix_and_the_targets_token():
    assert accept_run([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept, plus the bonus
    assert accept_run([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the target's own at the mismatch
    assert accept_run([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_run([], [3]) == [3]
    assert split_runs([4, 9, 6, 2, 8, 1], [[4, 5], [], [8]]) == [[4, 9], [2], [8, 1]]


def _chi2(counts: Counter, probs: torch.Tensor, total: int) -> float:
    expected = probs / probs.sum() * total
    return float(
        sum((counts.get(t, 0) - e) ** 2 / e for t, e in enumerate(expected.tolist()) if e > 0)
    )


def test_output_distribution_is_the_targets():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5  # positions: next, after draft 1, after draft 2
    params = SamplingParams(temperature=0.8, top_k=5)
    base = SamplingBatch.build([params] * 3, [0, 1, 2], [0] * 3, "cpu")
    p = filtered_probs(logits, base)
    draft = [int(p[0].argmax()), int(p[1].argmin())]  # a likely and an unlikely (filtered) one
    n = DRAWS
    _, runs = verify(
        logits.repeat(n, 1),
        [draft] * n,
        [params] * n,
        list(range(n)),  # one seed per draw
        [10] * n,
    )
    first = Counter(r[0] for r in runs)
    assert _chi2(first, p[0], n) < CHI2_CRIT_DF5
    # Given the first draft kept, the next token follows position 1's distribution: the
    # filtered-out draft is never kept (p = 0), so every run stops there.
    kept = [r for r in runs if r[0] == draft[0]]
    assert len(kept) > n // 4
    second = Counter(r[1] for r in kept)
    assert _chi2(second, p[1], len(kept)) < CHI2_CRIT_DF5
    assert all(len(r) == 2 for r in kept) and draft[1] not in second
    assert all(len(r) == 1 for r in runs if r[0] != draft[0])


def test_every_position_draws_what_a_plain_step_would():
    """Same seed, same output position, same logits: the same token, drafts or not (so seeded
    and greedy requests give the same output with speculation as without)."""
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0)]
    drafts = [[0, 1], []]
    targets, runs = verify(logits[[0, 1, 2, 3]], drafts, params, [5, 9], [7, 3])
    plain = sample(
        logits,
        SamplingBatch.build([params[0]] * 3 + [params[1]], [7, 8, 9, 3], [5, 5, 5, 9], "cpu"),
    )
    assert targets.tolist() == plain.tolist()
    assert runs[1] == [int(logits[3].argmax())]
    again, runs_again = verify(logits, drafts, params, [5, 9], [7, 3])
    assert again.tolist() == targets.tolist() and runs_again == runs  # reproducible


class _State:
    def __init__(self) -> None:
        self.params = SamplingParams(frequency_penalty=1.0)
        self.prompt_ids = [1]
        self.output_ids = [2]
        self.penalty_state = None


def test_positions_past_drafts_count_them_as_generated():
    from minisgl.layers.penalties import PenaltyState

    base = _State()
    states = expand_states([base], [[3, 3]])
    assert [s.output_ids for s in states] == [[2], [2, 3], [2, 3, 3]]
    base.penalty_state = PenaltyState.create(base.params, base.prompt_ids)
    base.penalty_state.catch_up(base.output_ids)
    ahead = states[2].penalty_state
    ahead.catch_up(states[2].output_ids)
    assert ahead is not base.penalty_state
    assert ahead.values[ahead.where[3]][2] == pytest.approx(2.0)  # counted twice
    assert 3 not in base.penalty_state.where  # the request's own counts untouched
