"""Verification of draft tokens against the target model's own draws.

A request with drafts d_1..d_k is scored at k + 1 positions in one forward: position j's logits
(after the last token and d_1..d_j) give the target's draw t_j, made exactly as a plain decode
step would make it (same penalties, grammar mask, filters, and the same random number: a pure
function of the request's seed and the output position). Drafts are kept while d_{j+1} == t_j;
the request then emits d_1..d_a and t_a (the bonus token when every draft was kept).

This is rejection sampling with each draft a point mass q = 1 at d: accepting d when the
target's draw equals it accepts with probability p(d) = min(1, p(d) / q(d)), and on a mismatch
the target's draw is distributed as p with d removed and renormalised, the residual
(p - q)+ / |p - q|+. So the output keeps the target's distribution; and because every position
uses the random number the plain step would have used there, a seeded (or greedy) request
produces token for token what it produces without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from minisgl.layers.sampling import SamplingBatch, sample
from minisgl.sampling_params import SamplingParams

T = TypeVar("T")


def accept_run(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a request emits: the drafts up to the first the target disagrees with, then
    the target's own token at that position. len(targets) == len(drafts) + 1."""
    assert len(targets) == len(drafts) + 1, (drafts, targets)
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return [int(t) for t in targets[: a + 1]]


def expand(values: Sequence[T], drafts: Sequence[Sequence[int]]) -> list[T]:
    """Per request -> per scored position: values[i] repeated 1 + len(drafts[i]) times."""
    return [v for v, d in zip(values, drafts, strict=True) for _ in range(len(d) + 1)]


def expand_steps(steps: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[int]:
    """The output position each scored position samples: a request's next, then one further
    per draft before it (the random number of a draw is keyed by it)."""
    return [s + j for s, d in zip(steps, drafts, strict=True) for j in range(len(d) + 1)]


def split_runs(targets: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The target's draws at every scored position (flat, request by request) -> the tokens
    each request emits."""
    runs = []
    at = 0
    for d in drafts:
        runs.append(accept_run(d, targets[at : at + len(d) + 1]))
        at += len(d) + 1
    return runs


def verify(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    steps: Sequence[int],
) -> tuple[torch.Tensor, list[list[int]]]:
    """Draw the target's token at every scored position and accept drafts against them.

    `logits` [sum(len(d) + 1), V]: every position's final logits (penalties and grammar mask
    already applied); params, seeds and steps are per request. Returns the draws (flat; for
    log-probabilities) and the tokens each request emits."""
    batch = SamplingBatch.build(
        expand(list(params), drafts),
        expand_steps(steps, drafts),
        expand(list(seeds), drafts),
        logits.device,
    )
    targets = sample(logits, batch)
    return targets, split_runs(targets.tolist(), drafts)


class _Ahead:
    """The sampling state of a scored position past some drafts: the request's, with the drafts
    counted as generated (penalties see them as if made one at a time). Its penalty counts are
    a copy of the request's, taken when first asked for: the request's own comes first in the
    batch, so it has caught up with the real output by then."""

    def __init__(self, base: Any, drafts: Sequence[int]) -> None:
        self.params = base.params
        self.prompt_ids = base.prompt_ids
        self.output_ids = base.output_ids + list(drafts)
        self._base = base
        self._state: Any = None

    @property
    def penalty_state(self) -> Any:
        if self._state is None and self._base.penalty_state is not None:
            self._state = self._base.penalty_state.copy()
        return self._state

    @penalty_state.setter
    def penalty_state(self, value: Any) -> None:
        self._state = value


def expand_states(states: Sequence[Any], drafts: Sequence[Sequence[int]]) -> list[Any]:
    """Per request -> per scored position: the request's own state, then one past each draft."""
    out: list[Any] = []
    for s, d in zip(states, drafts, strict=True):
        out.append(s)
        out += [_Ahead(s, d[:j]) for j in range(1, len(d) + 1)]
    return out
